"""Does `petatrain plan` lay out Llama-3-sized models as the people who train them do?

For each published layout of Llama 3 8B, 70B and 405B on H100s (torchtitan's benchmarks, NVIDIA's
Megatron-Bridge performance summary, Meta's Llama 3 paper), on the same GPU count and global batch:
plan's predicted step time for the published layout, and for the layout plan chooses itself
(`plan --accelerator H100-SXM --count N`). Plan's choice must be the published one, or predicted
faster with the reason stated (its per-layout explanation: what each pays besides compute, and the
memory term that decides). Where a source gives a bf16 throughput, plan's predicted tokens/s per
GPU for that layout stands beside it.

What plan cannot model is said in the row: context parallelism (CP), Float8, interleaved virtual
stages (Megatron's VP; plan counts the 1F1B bubble), asynchronous TP, grouped-query attention and
SwiGLU (the GPT here has full multi-head attention and a two-matrix MLP: d_ff is set to 1.5x the
SwiGLU width, the same parameters and FLOPs). The catalog's H100-SXM is the 80 GB part at its
default efficiency; torchtitan's runs were on 96 GB H100s at 500 W.

    .venv/bin/python benchmarks/plan_layouts.py      # table + benchmarks/results/plan_layouts.json

Sources (the helper read them at these versions):
  torchtitan  pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, Dec 2024)
              and benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md
  Megatron-Bridge  NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (release 25.09)
  Meta        "The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.2, Table 4
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import write_results  # noqa: E402
from petatrain import config as config_mod  # noqa: E402
from petatrain.plan.recommend import PlanRequest, evaluate_layout, explain_layout, plan  # noqa: E402

ROOT = HERE.parent
# Llama 3's shapes as the GPT here has them (d_ff: 1.5 x the SwiGLU width).
MODELS = {
    "8B": {"n_layer": 32, "d_model": 4096, "n_head": 32, "d_ff": 21504},
    "70B": {"n_layer": 80, "d_model": 8192, "n_head": 64, "d_ff": 43008},
    "405B": {"n_layer": 126, "d_model": 16384, "n_head": 128, "d_ff": 79872},
}
SAC = (
    "per-op selective recompute (all but the matmuls' outputs; plan's `selective` recomputes the attention "
    "core only), 96 GB H100s"
)
# (source, model, GPUs, global batch in sequences, layout, bf16 tokens/s/GPU published or None, what plan leaves out)
PUBLISHED = [
    ("torchtitan", "8B", 8, 16, {"data": "fsdp", "micro_batch": 2, "recompute": "selective"}, 5762, SAC),
    ("torchtitan", "8B", 128, 256, {"data": "fsdp", "micro_batch": 2, "recompute": "selective"}, 5605, SAC),
    (
        "Megatron-Bridge 25.09", "8B", 8, 128, {"data": "fsdp", "micro_batch": 1, "recompute": "none"}, None,
        "FP8 (plan: bf16)",
    ),
    (
        "torchtitan", "70B", 256, 512, {"tensor": 8, "data": "fsdp", "micro_batch": 16, "recompute": "full"}, 597,
        "published bf16 figure: torch.compile, no AsyncTP",
    ),
    (
        "Megatron-Bridge 25.09", "70B", 64, 128,
        {"tensor": 4, "stages": 8, "data": "fsdp", "micro_batch": 1, "recompute": "none"}, None,
        "FP8, interleaved VP 5 (plan: 1F1B), the distributed optimizer (plan: FSDP replicas, which also split the "
        "weights)",
    ),
    (
        "torchtitan", "405B", 512, 256,
        {"tensor": 8, "stages": 8, "data": "fsdp", "micro_batch": 1, "recompute": "full"}, None,
        "Float8, AsyncTP",
    ),
    (
        "Meta (Llama 3)", "405B", 8192, 2048,
        {"tensor": 8, "stages": 16, "data": "fsdp", "micro_batch": 1, "recompute": "none"}, None,
        "interleaved stages (plan: 1F1B), weights kept gathered after forward, first and last stages balanced by hand",
    ),
]  # fmt: skip


def job(model: str, global_batch: int, layout: dict) -> config_mod.JobConfig:
    """The model, with the published run's batch, micro-batch and recompute policy in its config: plan
    evaluates DDP and FSDP at the config's, and searches them for pipelines and tensor parallelism."""
    sets = [f"model.{k}={v}" for k, v in MODELS[model].items()]
    sets += ["model.vocab_size=128256", "model.seq_len=8192", f"train.global_batch={global_batch}"]
    sets += [f"train.micro_batch={layout['micro_batch']}", f"train.activation_checkpointing={layout['recompute']}"]
    return config_mod.load(ROOT / "examples" / "plan-70b.yaml", sets)


def main() -> None:
    rows = []
    for source, model, gpus, batch, layout, published_tps, leaves_out in PUBLISHED:
        cfg = job(model, batch, layout)
        theirs = evaluate_layout(cfg, "H100-SXM", gpus, **layout)
        ours = plan(cfg, PlanRequest(accelerator="H100-SXM", count=gpus)).recommended
        if ours is None:
            raise SystemExit(f"plan found no layout for {model} on {gpus} H100s")
        tokens = batch * cfg.model.seq_len
        same = ours.layout.get("label", ours.strategy) == theirs.layout["label"] or (
            abs(ours.step_time_s - theirs.step_time_s) < 1e-9
        )
        if theirs.reason:  # plan's memory model says no: what it leaves out is named in the row
            verdict = f"plan says the published layout does not fit: {theirs.reason.partition(': ')[2]}"
        elif same:
            verdict = "plan chooses it"
        elif ours.step_time_s < theirs.step_time_s:
            verdict = f"plan's is predicted {theirs.step_time_s / ours.step_time_s - 1:.0%} faster"
        else:
            verdict = f"plan's is predicted {1 - theirs.step_time_s / ours.step_time_s:.0%} slower (cheaper)"
        rows.append(
            {
                "source": source,
                "model": model,
                "gpus": gpus,
                "global_batch": batch,
                "published": theirs.layout["label"],
                "published_step_s": round(theirs.step_time_s, 3),
                "published_fits": theirs.fits,
                "published_tokens_per_s_per_gpu": published_tps,
                "predicted_tokens_per_s_per_gpu": round(tokens / theirs.step_time_s / gpus, 1),
                "plan": ours.layout.get("label", ours.strategy),
                "plan_step_s": round(ours.step_time_s, 3),
                "verdict": verdict,
                "why_published": explain_layout(theirs),
                "why_plan": explain_layout(ours),
                "plan_leaves_out": leaves_out,
            }
        )
    head = f"{'source':<22} {'model':>5} {'GPUs':>5} {'published layout':<48} {'step s':>8}"
    print(f"{head} {'tok/s/GPU pred (pub)':>21}")
    print(f"{'':<34} {'plan layout':<48} {'step s':>8}  verdict")
    for r in rows:
        pub = f"{r['predicted_tokens_per_s_per_gpu']:,.0f}" + (
            f" ({r['published_tokens_per_s_per_gpu']:,})" if r["published_tokens_per_s_per_gpu"] else ""
        )
        print(
            f"{r['source']:<22} {r['model']:>5} {r['gpus']:>5} {r['published']:<48} {r['published_step_s']:>8.3g} "
            f"{pub:>21}"
        )
        print(f"{'':<34} {r['plan']:<48} {r['plan_step_s']:>8.3g}  {r['verdict']}")
        print(f"{'':<34} why: {r['why_plan']}")
        if r["plan_leaves_out"]:
            print(f"{'':<34} plan does not model: {r['plan_leaves_out']}")
    write_results(
        "plan_layouts",
        {
            "accelerator": "H100-SXM (catalog: 80 GB, default efficiency)",
            "models": MODELS,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
