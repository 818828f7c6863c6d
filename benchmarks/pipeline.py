"""Pipeline parallelism: bubble, partitioner, a plain torch.distributed.pipelining peer, recovery.

Runs, on this machine, with a GPT on the byte-token dataset of benchmarks/recovery.py:

1. bubble: every schedule (gpipe, 1f1b, interleaved, zbv) at 2 stages and 2, 4, 8 micro-batches:
   the idle share of each stage's steps (measured by petatrain's stage clock, set-up window left
   out) beside the schedule's (P-1)/(vM+P-1), and tokens/s. On CPU the idle share also holds
   gloo's point-to-point work and the loss, which the formula does not: the gap is that overhead.
2. partitioner: a model whose head outweighs a block (a large vocabulary: the head's matmul costs
   compute, the embedding's lookup does not, though both hold V x d parameters): `profile --layers`,
   then one run per partition (uniform, parameters, profile): median step time, each stage's
   predicted compute beside the measured, and the profile partition run again to show how far two
   runs of one config differ here (the floor under any prediction's error).
3. peer: the same model and schedule (1f1b, 2 stages, 4 micro-batches) as a plain
   torch.distributed.pipelining script (2 processes, gloo, no Ray, no checkpoints): tokens/s of
   petatrain's pipeline (its checkpoint only at the end, as the peer has none) relative to it.
4. recovery: a kill of rank 1 at step 12, in the pipeline and in DDP: detection and time to the
   next productive step, from the report.

    .venv/bin/python benchmarks/pipeline.py [--only bubble,partition,peer,recovery] [--steps 30]

Prints tables and writes benchmarks/results/pipeline.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import typing

from _common import RESULTS, WORK, write_results  # benchmarks/ is not a package
from petatrain import api, config
from recovery import dataset

SCHEDULES = typing.get_args(config.Schedule)
MICROBATCHES = (2, 4, 8)


def job(data: str, steps: int, *overrides: str) -> config.JobConfig:
    base = [
        f"data.dataset={data}", f"train.steps={steps}", "train.global_batch=16", "train.micro_batch=8",
        "model.n_layer=4", "model.d_model=64", "model.n_head=2", "model.seq_len=64", "model.vocab_size=320",
        "train.warmup_steps=2", "train.eval_every=0", "checkpoint.every=10", "checkpoint.keep_last=1",
        "parallel.workers=2", "faults.hang_timeout_s=20",
    ]  # fmt: skip
    return config.load(None, [*base, *overrides])


def pipeline(schedule: str, m: int, partition: str = "uniform") -> list[str]:
    return [
        "parallel.strategy=pipeline", "parallel.pipeline.stages=2", f"parallel.pipeline.schedule={schedule}",
        f"parallel.pipeline.microbatches={m}", f"parallel.pipeline.partition={partition}",
    ]  # fmt: skip


def run(cfg: config.JobConfig, *injections: str) -> dict:
    folder = tempfile.mkdtemp(dir=WORK, prefix="pp-")
    try:
        result = api.train(cfg, run_dir=folder, injections=injections)
        report = result.report.to_dict()
        with open(f"{folder}/events.jsonl") as handle:
            steps = [json.loads(line) for line in handle]
        step_s = [e["step_s"] for e in steps if e.get("event") == "step" and e["step"] > 5]
        return {
            "report": report,
            "median_step_s": statistics.median(step_s),
            "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / statistics.median(step_s),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def bubble(data: str, steps: int) -> list[dict]:
    rows = []
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            if schedule != "gpipe" and m < 2:
                continue
            out = run(job(data, steps, *pipeline(schedule, m)))
            p = out["report"]["pipeline"]
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "bubble_measured": p["bubble_measured"],
                    "bubble_theory": p["bubble_theory"],
                    "tokens_per_s": out["tokens_per_s"],
                }
            )
            print(
                f"{schedule:12s} M={m}  bubble measured {p['bubble_measured']:.1%}  theory {p['bubble_theory']:.1%}  "
                f"{out['tokens_per_s']:,.0f} tokens/s",
                flush=True,
            )
    return rows


def partition(data: str, steps: int) -> dict:
    """The unbalanced model: vocabulary 8192 (the head's matmul), d_model 64, 4 blocks."""
    cal = str(WORK / "pipeline-calibration")
    shutil.rmtree(cal, ignore_errors=True)
    heavy = ["model.vocab_size=8192", f"plan.calibration_dir={cal}"]
    layers = api.profile_layers(job(data, steps, *heavy, *pipeline("1f1b", 4)), repetitions=5)
    print("units (ms):", [round(1e3 * s, 2) for s in layers["profile"]["seconds"]], flush=True)
    rows = []
    for how in ("uniform", "parameters", "profile"):
        out = run(job(data, steps, *heavy, *pipeline("1f1b", 4, how)))
        predicted = next(c for c in layers["partitions"] if c["partition"] == how)
        stages = out["report"]["pipeline"]["stages_measured"]
        rows.append(
            {
                "partition": how,
                "starts": predicted["starts"],
                "median_step_s": out["median_step_s"],
                "predicted_step_s": predicted["step_s"],
                "stages": [
                    {
                        "units": s["units"],
                        "measured_busy_s": s["busy_s"],
                        "predicted_busy_s": s["predicted_busy_s"],
                        "error": s["prediction_error"],
                    }
                    for s in stages
                ],
            }
        )
        errors = ", ".join(f"{s['prediction_error']:+.1%}" for s in stages if s["prediction_error"] is not None)
        print(
            f"partition {how:10s} starts {predicted['starts']}  step {1e3 * out['median_step_s']:.1f} ms "
            f"(predicted {1e3 * predicted['step_s']:.1f})  stage errors {errors}",
            flush=True,
        )
    # The host's own noise: the profile partition again, minutes later; a prediction cannot be
    # judged closer than two runs of the same config agree
    again = run(job(data, steps, *heavy, *pipeline("1f1b", 4, "profile")))["report"]["pipeline"]["stages_measured"]
    first = rows[-1]["stages"]
    spread = [abs(a["busy_s"] - b["measured_busy_s"]) / b["measured_busy_s"] for a, b in zip(again, first, strict=True)]
    print("same config twice: stage compute differs by " + ", ".join(f"{x:.1%}" for x in spread), flush=True)
    return {"units": layers["profile"], "runs": rows, "same_config_spread": spread}


# -- the peer: plain torch.distributed.pipelining ------------------------------------------------


def _peer_rank(rank: int, init: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from petatrain.config import ModelConfig
    from petatrain.models.gpt import GPT, logits_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT(ModelConfig(kind="gpt", n_layer=4, n_head=2, d_model=64, vocab_size=320, seq_len=64, dropout=0.0))

    class Half(nn.Module):  # what a user writes by hand: the first half or the second half
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(model.blocks[:2] if rank == 0 else model.blocks[2:])
            self.wte, self.wpe, self.ln_f, self.head = model.wte, model.wpe, model.ln_f, model.head

        def forward(self, x):
            if rank == 0:
                x = self.wte(x) + self.wpe(torch.arange(x.size(1)))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if rank == 1 else x

    half = Half()
    stage = PipelineStage(half, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=logits_loss)
    optimizer = torch.optim.AdamW(half.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, 320, (16, 65), generator=gen)
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"median_step_s": statistics.median(times[5:])}, handle)
    dist.destroy_process_group()


def peer(data: str, steps: int, repetitions: int = 3) -> dict:
    """Alternating repetitions (plain, petatrain, plain, ...): this shared machine's speed drifts
    between runs, so the ratio is taken per pair and its median reported."""
    import torch.multiprocessing as mp

    tokens = 16 * 64
    plain, ours = [], []
    for _ in range(repetitions):
        with tempfile.TemporaryDirectory() as folder:
            out = f"{folder}/peer.json"
            mp.start_processes(_peer_rank, args=(f"file://{folder}/store", steps, out), nprocs=2, start_method="spawn")
            with open(out) as handle:
                plain.append(tokens / json.load(handle)["median_step_s"])
        # as the peer: no checkpoint until the end
        ours.append(run(job(data, steps, *pipeline("1f1b", 4), "checkpoint.every=1000"))["tokens_per_s"])
    ratios = sorted(o / p for o, p in zip(ours, plain, strict=True))
    row = {
        "plain_tokens_per_s": plain,
        "petatrain_tokens_per_s": ours,
        "paired_ratios": ratios,
        "ratio_median": statistics.median(ratios),
    }
    print(
        f"1f1b 2 stages M=4: plain torch.distributed.pipelining {statistics.median(plain):,.0f} tokens/s, petatrain "
        f"{statistics.median(ours):,.0f}; paired ratios {', '.join(f'{r:.3f}' for r in ratios)}",
        flush=True,
    )
    return row


def recovery(data: str, steps: int) -> list[dict]:
    rows = []
    for name, overrides in (("pipeline 1f1b", pipeline("1f1b", 4)), ("ddp", [])):
        out = run(job(data, steps, *overrides), "kill@step=12,rank=1")
        (fault,) = out["report"]["faults"]
        rows.append(
            {
                "strategy": name,
                "detected_after_s": fault["detected_after_s"],
                "recovered_after_s": fault["recovered_after_s"],
                "steps_lost": fault["steps_lost"],
            }
        )
        print(
            f"{name:14s} kill detected after {fault['detected_after_s']:.2f} s, next productive step after "
            f"{fault['recovered_after_s']:.2f} s, {fault['steps_lost']} steps lost",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="bubble,partition,peer,recovery")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    WORK.mkdir(exist_ok=True)
    data = dataset()
    sections = {"bubble": bubble, "partition": partition, "peer": peer, "recovery": recovery}
    results = {}
    for name in args.only.split(","):
        if name not in sections:
            sys.exit(f"--only: unknown section {name!r} (one of {', '.join(sections)})")
        print(f"== {name}", flush=True)
        results[name] = sections[name](data, args.steps)
    previous = RESULTS / "pipeline.json"
    if previous.exists() and set(results) != set(sections):  # a partial run updates its sections only
        kept = {k: v for k, v in json.loads(previous.read_text()).items() if k in sections and k not in results}
        results = {**kept, **results}
    write_results("pipeline", {"steps": args.steps, **results})


if __name__ == "__main__":
    main()
