"""How close is `petatrain plan` to a measurement, and to the estimators people use today?

On the same configs (real CPU training steps of petatrain's GPT/MLP):

- measured: peak live tensor bytes of one real training step under torch's MemTracker
  (torch.distributed._tools), after a warm-up step;
- petatrain: plan.estimate.memory_per_device for the same run;
- accelerate: `accelerate estimate-memory`'s "Training using Adam" column — its own
  `calculate_maximum_sizes` on the model, times 4 (accelerate/commands/estimate.py);
- DeepSpeed: `estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs`
  (no offload, 1 GPU), DeepSpeed's own functions.

If accelerate or DeepSpeed cannot be imported, their documented formulas are computed
here instead and the output says so. Also measured: the FLOP counter against the analytic
count and against torch's FlopCounterMode, and the time `plan` takes for a 70B config
over the whole catalog (in process, and the CLI end to end).

Writes benchmarks/results/plan_accuracy.json with the machine it ran on.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from _common import write_results  # noqa: E402
from petatrain import config as config_mod  # noqa: E402
from petatrain.config import JobConfig, ModelConfig, TrainConfig  # noqa: E402
from petatrain.models import build_model  # noqa: E402
from petatrain.plan import estimate as est  # noqa: E402
from petatrain.plan.flops import count_training_step  # noqa: E402
from petatrain.plan.recommend import plan  # noqa: E402
from test_plan import MEMORY_CONFIGS, measure_peak  # noqa: E402


def accelerate_training_bytes(model: torch.nn.Module) -> tuple[float, str]:
    """accelerate estimate-memory, "Training using Adam" for the model's dtype: total size × 4."""
    try:
        import accelerate
        from accelerate.utils import calculate_maximum_sizes

        total, _ = calculate_maximum_sizes(model)
        return total * 4, f"accelerate {accelerate.__version__} calculate_maximum_sizes x 4"
    except ImportError:
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        return total * 4, "accelerate not importable: its formula (parameter bytes x 4) computed here"


def deepspeed_bytes(model: torch.nn.Module) -> tuple[float, float, str]:
    """DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimators, no offload, one GPU."""
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    try:
        import deepspeed
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        z2 = estimate_zero2_model_states_mem_needs(params, cpu_offload=False)[1]
        z3 = estimate_zero3_model_states_mem_needs(params, largest, cpu_offload=False)[1]
        return z2, z3, f"deepspeed {deepspeed.__version__} estimate_zero{{2,3}}_model_states_mem_needs"
    except ImportError:
        # deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, cpu_offload=False.
        z2 = 4 * params + int(16 * params / 1)
        z3 = 4 * largest + int(18 * params / 1)
        return z2, z3, "deepspeed not importable: its formulas (4P + 16P/N; 4L + 18P/N) computed here"


def memory_table() -> tuple[list[dict], dict]:
    rows, sources = [], {}
    for model_kw, train_kw in MEMORY_CONFIGS:
        train_kw = {"global_batch": train_kw.get("micro_batch", 8), **train_kw}
        cfg = JobConfig(model=ModelConfig(**model_kw), train=TrainConfig(**train_kw))
        measured = measure_peak(cfg)
        w = est.Workload.from_config(cfg)
        ours = est.memory_per_device(w, strategy="ddp", count=1, cpu=True)
        model = build_model(cfg.model, cfg.train).module
        acc, sources["accelerate"] = accelerate_training_bytes(model)
        z2, z3, sources["deepspeed"] = deepspeed_bytes(model)
        label = ", ".join(f"{k}={v}" for k, v in {**model_kw, **train_kw}.items()) or "defaults"
        rows.append(
            {
                "config": label,
                "params": w.params,
                "measured_bytes": measured,
                "petatrain_bytes": ours.total,
                "petatrain_peak_moment": ours.phase,
                "accelerate_bytes": acc,
                "deepspeed_zero2_bytes": z2,
                "deepspeed_zero3_bytes": z3,
                "petatrain_error": (ours.total - measured) / measured,
                "accelerate_error": (acc - measured) / measured,
                "deepspeed_zero2_error": (z2 - measured) / measured,
                "deepspeed_zero3_error": (z3 - measured) / measured,
            }
        )
    return rows, sources


def flops_table() -> list[dict]:
    from torch.utils.flop_counter import FlopCounterMode

    rows = []
    for model_kw in ({}, {"n_layer": 3, "n_head": 4, "d_model": 128, "vocab_size": 1000, "seq_len": 128}):
        for train_kw in ({}, {"attention": "math"}, {"activation_checkpointing": "full"}):
            cfg = JobConfig(model=ModelConfig(**model_kw), train=TrainConfig(global_batch=4, micro_batch=4, **train_kw))
            torch.manual_seed(0)
            spec = build_model(cfg.model, cfg.train)
            model = spec.module.train()
            tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1))
            ours = count_training_step(model, spec.loss_fn, tokens).total
            model.zero_grad()
            with FlopCounterMode(display=False) as theirs:
                spec.loss_fn(model, tokens).backward()
            analytic = est.Workload.from_config(cfg).executed_flops(4)
            rows.append(
                {
                    "config": ", ".join(f"{k}={v}" for k, v in {**model_kw, **train_kw}.items()) or "defaults",
                    "analytic": analytic,
                    "petatrain_counter": ours,
                    "torch_flop_counter_mode": theirs.get_total_flops(),
                    "counter_error": (ours - analytic) / analytic,
                    "torch_error": (theirs.get_total_flops() - analytic) / analytic,
                }
            )
    return rows


def plan_speed() -> dict:
    cfg = config_mod.load(ROOT / "examples" / "plan-70b.yaml")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        result = plan(cfg)
        times.append(time.perf_counter() - t0)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "petatrain", "plan", str(ROOT / "examples" / "plan-70b.yaml"), "--json"],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        walls.append(time.perf_counter() - t0)
    return {
        "config": "examples/plan-70b.yaml",
        "params": result.workload.params,
        "candidates": len(result.candidates),
        "in_process_s_median": statistics.median(times),
        "cli_end_to_end_s_median": statistics.median(walls),
    }


def main() -> None:
    memory, sources = memory_table()
    flops = flops_table()
    speed = plan_speed()

    def pct(x):
        return f"{100 * x:+7.1f}%"

    print("peak memory per device: estimate vs torch MemTracker on a real CPU step")
    print(f"{'config':<62} {'measured':>10} {'petatrain':>10} {'accelerate':>10} {'DS zero2':>10} {'DS zero3':>10}")
    for r in memory:
        print(
            f"{r['config'][:62]:<62} {r['measured_bytes'] / 2**20:8.2f}Mi {pct(r['petatrain_error']):>10} "
            f"{pct(r['accelerate_error']):>10} {pct(r['deepspeed_zero2_error']):>10} "
            f"{pct(r['deepspeed_zero3_error']):>10}"
        )
    summary = {
        name: statistics.median(abs(r[f"{name}_error"]) for r in memory)
        for name in ("petatrain", "accelerate", "deepspeed_zero2", "deepspeed_zero3")
    }
    worst = max(abs(r["petatrain_error"]) for r in memory)
    print("median |error|: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in summary.items()))
    print(f"petatrain worst |error|: {100 * worst:.1f}% over {len(memory)} configs")
    print(f"accelerate: {sources['accelerate']}\ndeepspeed: {sources['deepspeed']}")
    print("\nFLOPs per training step (forward + backward [+ recompute]) vs the analytic count")
    for r in flops:
        print(
            f"{r['config'][:62]:<62} counter {pct(r['counter_error'])}   torch FlopCounterMode {pct(r['torch_error'])}"
        )
    print(
        f"\nplan for a {speed['params'] / 1e9:.1f}B config over the catalog ({speed['candidates']} candidates): "
        f"{speed['in_process_s_median'] * 1e3:.1f} ms in process, "
        f"{speed['cli_end_to_end_s_median']:.2f} s CLI end to end"
    )
    out = {
        "memory": memory,
        "memory_median_abs_error": summary,
        "memory_sources": sources,
        "flops": flops,
        "plan_speed": speed,
    }
    write_results("plan_accuracy", out)


if __name__ == "__main__":
    main()
