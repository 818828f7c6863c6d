r"""The GPU check: petatrain's Ray-free layers measured on one GPU, in one process, in <= 8 minutes.

On the GPU machine (torch, pyarrow, safetensors, tokenizers, xxhash, pyyaml ... installed; no Ray,
no internet), from the repository root, with the wheels `make gpu-wheels` put in .whl/ (git-ignored:
name it among the paths a device run carries), one command:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out $OUT

(`make gpu-check` runs the same, writing into benchmarks/results/.) It prints a table per
part and writes gpu-<device>.json into --out (default benchmarks/results/) with the device, torch and
CUDA versions. The parts, each in its own time box, each recording its own failure (a one-line error
in the JSON) before the next one runs; `--only PART` runs one:

  train       tokens/s and MFU of the GPT at ~125M, ~350M and ~1.3B parameters (bf16 autocast, fused
              AdamW, SDPA), without and with activation checkpointing, eager and compiled: petatrain's
              own step (models.build_model, train.steps.MicroBatches over train.recipe's optimizer,
              autocast, micro-batch loss, clipping and update) against a plain nanoGPT-style loop of the
              same model written here. Goal: petatrain / plain >= 0.97; MFU >= 45% at 1.3B.
  plan        `plan`'s predicted peak memory and step time (plan.profile.profile: the estimate held to a
              measurement) for six configs. Goal: memory within 5%, step time within 15%.
  checkpoint  the training loop's stall per checkpoint at 1.3B: petatrain's writer (loop._snapshot staged
              on the GPU, the writer moving it to pinned host buffers; and with checkpoint.staging=copy,
              the loop waiting for the copy to pinned host buffers; CheckpointWriter) against torch DCP
              async_save (no process group; and with a pinned stager) and torch.save, as a share of a
              10 s interval, and restore time (petatrain's restored weights checked against the
              snapshot's, changed right after it). Goal: <= 0.1% of 10 s.
  loader      the streaming loader (train.batches.TokenBatches over data.stream) feeding the 350M model
              from a packed-token dataset written here on local disk: data-wait share of the step. Goal: < 1%.
  serve       serve.engine's KV-cached batched decode at batch 1, 8 and 32, tokens/s, against recomputing
              the prefix for every token.
  partition   the layer profile (`profile --layers`: train.pipeline.costs.measure) and the pipeline
              partitioner's predicted per-stage time against each stage run alone, one after another.
              Goal: within 10%.
  comm        a traced step's communication per mesh dimension (train.trace, the report's mesh table)
              on this process's own group of one rank (NCCL on the GPU, with its flight recorder's
              timing on; gloo in the smoke): which recorder torch has, and whether each dimension's
              collectives come back with their calls, MiB and time. No goal: the NCCL path has not run
              anywhere yet.

Nothing here imports Ray (the GPU machine has none): `ray` is blocked at start, so a Ray import on
any path fails the part that made it. `--smoke` runs every part on the CPU at tiny sizes (under a
minute on 2 cores) to check the code; its JSON and table say "cpu smoke, not a GPU figure", and it
writes into a temporary folder unless --out is given:

    .venv/bin/python benchmarks/gpu.py --smoke --out /tmp/gpu-smoke
"""

# ruff: noqa: E402  (the imports follow the line that blocks Ray)
from __future__ import annotations

import sys

sys.modules.setdefault("ray", None)  # type: ignore[arg-type]  # the GPU machine has no Ray: fail here as there

import argparse
import contextlib
import gc
import importlib
import inspect
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from _common import RESULTS, version  # benchmarks/ is not a package
from checkpoint import restore_petatrain, restore_torch_load
from petatrain.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    PipelineConfig,
    PlanConfig,
    TrainConfig,
)
from petatrain.models import build_model
from petatrain.plan.catalog import load_catalog
from petatrain.plan.estimate import Workload
from petatrain.plan.profile import catalog_name, measure_cpu_matmul_peak, profile
from petatrain.train import checkpoint as ckpt
from petatrain.train import loop, recipe
from petatrain.train.steps import MicroBatches

PARTS = ("train", "plan", "checkpoint", "loader", "serve", "partition", "comm")
# Each part's share of the run's budget (seconds of the GPU run's 430 when every part runs, nearly).
SHARES = {"train": 185, "plan": 75, "checkpoint": 95, "loader": 30, "serve": 25, "partition": 20, "comm": 10}
GPU_BUDGET_S = 430.0  # 8 minutes less the start (imports, CUDA) and the margin below
ALARM_MARGIN_S = 20  # past the budget by this much, the part running is stopped (SIGALRM)
SMOKE_BUDGET_S = 300.0  # the smoke is not cut short: it is its own check
SMOKE_NOTE = "cpu smoke, not a GPU figure"
INTERVAL_S = 10.0  # the checkpoint interval the stall is a share of
GOALS = {
    "train_ratio": 0.97,
    "mfu_large": 0.45,
    "plan_memory": 0.05,
    "plan_step": 0.15,
    "checkpoint_share": 0.001,
    "loader_wait": 0.01,
    "partition": 0.10,
}


class BudgetExceeded(BaseException):
    """The whole run's time is up (SIGALRM): the part running records it, the rest are skipped.
    A BaseException, so that the rows' own `except Exception` do not swallow it."""


# -- sizes -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """A GPT shape and the micro-batch the train part runs it at."""

    n_layer: int
    n_head: int
    d_model: int
    micro: int
    vocab: int
    seq_len: int

    def model(self) -> ModelConfig:
        return ModelConfig(
            n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model, vocab_size=self.vocab, seq_len=self.seq_len
        )

    @property
    def params(self) -> int:
        return Workload.from_config(JobConfig(model=self.model())).params

    @property
    def label(self) -> str:
        p = self.params
        return f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.0f}M" if p >= 1e6 else f"{p / 1e3:.0f}K"


# GPT-2 small / medium and GPT-3 XL shapes, context 1024; the vocabulary is GPT-2's 50257 padded to a
# multiple of 64 (as nanoGPT does: tensor-core friendly), the same for every contestant.
GPU_SIZES = {
    "small": Size(n_layer=12, n_head=12, d_model=768, micro=16, vocab=50304, seq_len=1024),
    "medium": Size(n_layer=24, n_head=16, d_model=1024, micro=16, vocab=50304, seq_len=1024),
    "large": Size(n_layer=24, n_head=16, d_model=2048, micro=8, vocab=50304, seq_len=1024),
}
SMOKE_SIZES = {  # the medium has 4 blocks: the partition part cuts it into 4 stages
    "small": Size(n_layer=1, n_head=2, d_model=32, micro=2, vocab=128, seq_len=32),
    "medium": Size(n_layer=4, n_head=2, d_model=32, micro=4, vocab=128, seq_len=32),
    "large": Size(n_layer=2, n_head=2, d_model=64, micro=2, vocab=128, seq_len=32),
}
# 2.7B (GPT-3's): the next size the checkpoint part would try, where the disk and memory allow.
GPU_LARGER = [Size(n_layer=32, n_head=32, d_model=2560, micro=4, vocab=50304, seq_len=1024)]


@dataclass(frozen=True)
class Mode:
    """The GPU run's sizes and lengths, or the CPU smoke's (tiny: it checks the code, measures nothing)."""

    smoke: bool
    device: torch.device
    sizes: dict[str, Size]
    warmup: int  # untimed steps (the first compiles, allocates, fills the optimizer state)
    steps: int  # timed steps
    compile_backend: str
    dataset_mb: int
    decode: tuple[int, int]  # (prompt tokens, new tokens) per request
    serve_batches: tuple[int, ...] = (1, 8, 32)

    @classmethod
    def for_run(cls, smoke: bool) -> Mode:
        if smoke:
            # dynamo's tracing without inductor's code generation: 45 s per model on 2 CPU cores
            return cls(True, torch.device("cpu"), SMOKE_SIZES, 1, 2, "eager", 2, (4, 4))
        return cls(False, torch.device("cuda"), GPU_SIZES, 3, 10, "inductor", 320, (64, 64))


def job(
    size: Size,
    micro: int,
    *,
    accumulation: int = 1,
    recompute: str = "none",
    compiled: bool = False,
    deterministic: bool = False,
    precision: str = "bf16-mixed",
    **sections: Any,
) -> JobConfig:
    """A job config for `size`: bf16-mixed, AdamW, SDPA, clipping at 1.0 (train's defaults otherwise)."""
    train = TrainConfig(
        micro_batch=micro,
        global_batch=micro * accumulation,
        precision=precision,
        activation_checkpointing=recompute,
        compile=compiled,
        deterministic=deterministic,
    )
    return JobConfig(model=size.model(), train=train, **sections)


# -- small helpers ---------------------------------------------------------------------------------------


@dataclass
class Box:
    """A part's time box: a row starts only while its estimated cost fits in what is left."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s

    def need(self, estimate_s: float) -> None:
        """For a part that is one piece: refuse to start it without the time it takes."""
        if not self.allows(estimate_s):
            raise TimeoutError(f"time box: {self.left():.0f} s left, about {estimate_s:.0f} s needed")


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Drop what the last row left (its model, optimizer, activations) before the next allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def error_of(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def pct(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def storage_of(path: str | Path) -> str:
    """The folder and the file system it is on (a tmpfs /tmp writes at memory speed, a disk does not)."""
    path, best, kind = os.path.realpath(path), "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as handle:
        for line in handle:
            _, mount, fstype = line.split()[:3]
            if path.startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return f"{path} ({kind})"


def dcp_kwargs(function: Callable, **wanted: Any) -> dict[str, Any]:
    """The keyword arguments `function` takes of `wanted` (torch 2.11 on the GPU machine, 2.13 here)."""
    names = inspect.signature(function).parameters
    return {k: v for k, v in wanted.items() if k in names}


class RandomTokens:
    """A few random (micro, seq_len + 1) batches on the device, cycled: the train part measures the step."""

    def __init__(self, cfg: JobConfig, device: torch.device):
        gen = torch.Generator().manual_seed(1)
        shape = (cfg.train.micro_batch, cfg.model.seq_len + 1)
        batches = [torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device) for _ in range(4)]
        self._cycle = itertools.cycle(batches)

    def next(self) -> torch.Tensor:
        return next(self._cycle)


def build_on(device: torch.device, cfg: JobConfig, backend: str):
    """The model as the worker loop builds it (`loop._build_model`, train.compile applied there), its
    parameters made on `device` (initialised there: a 1.3B GPT takes seconds to initialise on the CPU).
    The smoke compiles with a cheaper backend than the loop's default."""
    with torch.device(device):
        if not cfg.train.compile or backend == "inductor":
            return loop._build_model(cfg)
        spec = loop._build_model(replace(cfg, train=replace(cfg.train, compile=False)))
    spec.module.compile(backend=backend)
    return spec


# -- part 1: training throughput --------------------------------------------------------------------------


def train_petatrain(mode: Mode, cfg: JobConfig) -> dict[str, Any]:
    """petatrain's step as the worker loop runs it on one rank: `MicroBatches.forward_backward` (the
    recipe's autocast and micro-batch loss), `recipe.apply_gradients` (clip, update), the loss read."""
    step, optimizer = loop_step(mode, cfg, RandomTokens(cfg, mode.device).next)
    result = timed_steps(mode, step)
    result["fused_adamw"] = bool(optimizer.defaults.get("fused"))
    return result


def loop_step(mode: Mode, cfg: JobConfig, next_batch: Callable[[], torch.Tensor]):
    """The worker loop's step on one rank, from a model built as the loop builds it, and its optimizer:
    the recipe's learning rate, `MicroBatches.forward_backward`, `recipe.apply_gradients`, the loss read."""
    device, tr = mode.device, cfg.train
    torch.manual_seed(tr.seed)
    spec = build_on(device, cfg, mode.compile_backend)
    model = spec.module.train()
    optimizer = recipe.build_optimizer(model, tr)
    runner = MicroBatches(model=model, spec=spec, accumulation=1, world=1)
    amp = recipe.autocast(tr, device)

    def step(i: int) -> None:
        recipe.set_lr(optimizer, i, tr)
        loss_sum = runner.forward_backward(next_batch, amp)
        flags = recipe.step_flags(loss_sum, (False,) * 4)  # the loop's: loss, preemption, due, halt, resize
        norm, _ = recipe.apply_gradients(model, optimizer, tr, clip=runner.clip)
        recipe.read_step(flags, norm)  # the loop's one host read a step: its all-reduced flags, the norm

    return step, optimizer


def train_plain(mode: Mode, cfg: JobConfig) -> dict[str, Any]:
    """A plain PyTorch loop, nanoGPT's: the same GPT, AdamW over the same groups (fused on CUDA),
    autocast, cross-entropy, clip_grad_norm_, step; nothing read back per step; torch.compile(model)."""
    device, tr = mode.device, cfg.train
    torch.manual_seed(tr.seed)
    with torch.device(device):
        model = build_model(cfg.model, replace(tr, compile=False)).module.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tr.weight_decay}, {"params": other, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=tr.lr, betas=(tr.beta1, tr.beta2), fused=device.type == "cuda")
    forward = torch.compile(model, backend=mode.compile_backend) if tr.compile else model
    batches = RandomTokens(cfg, device)

    def step(i: int) -> None:
        tokens = batches.next()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_steps(mode, step)


def timed_steps(mode: Mode, step: Callable[[int], None]) -> dict[str, Any]:
    """Warm-up steps (the first one compiles), then `mode.steps` timed back to back (one sync at the end)."""
    device = mode.device
    started = time.perf_counter()
    step(0)
    sync(device)
    first_s = time.perf_counter() - started
    for i in range(1, mode.warmup):
        step(i)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for i in range(mode.steps):
        step(mode.warmup + i)
    sync(device)
    return {
        "step_s": (time.perf_counter() - started) / mode.steps,
        "first_step_s": first_s,
        "peak_gib": peak_gib(device),
    }


def train_rows(mode: Mode) -> list[tuple[str, str, bool, bool]]:
    """(size, recompute, compiled, deterministic) in the order they run: what the time box cuts is last."""
    sizes = list(mode.sizes)
    rows = [(s, "none", False, False) for s in sizes]
    rows += [(s, "full", False, False) for s in sizes]
    rows += [("large", "none", False, True)]  # as `train` runs by default (train.deterministic: true)
    rows += [(s, "none", True, False) for s in reversed(sizes)]  # the large first: the MFU goal is its
    rows += [("large", "full", True, False)]
    return rows


def part_train(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    peak, peak_source = ctx["peak_flops"], ctx["peak_source"]
    rows: list[dict[str, Any]] = ctx.setdefault("progress", [])  # kept if the part is cut short
    took: dict[tuple[str, bool], float] = {}
    for role, recompute, compiled, deterministic in train_rows(mode):
        size = mode.sizes[role]
        cfg = job(size, size.micro, recompute=recompute, compiled=compiled, deterministic=deterministic)
        w = Workload.from_config(cfg)
        row: dict[str, Any] = {
            "model": size.label,
            "params": size.params,
            "micro_batch": size.micro,
            "seq_len": size.seq_len,
            "recompute": recompute,
            "compile": mode.compile_backend if compiled else None,
            "deterministic": deterministic,
            "tokens_per_step": size.micro * size.seq_len,
            "model_flops_per_step": w.model_flops(size.micro),
            "executed_flops_per_step": w.executed_flops(size.micro),
        }
        default = (4.0 if compiled else 1.0) if mode.smoke else (50.0 if compiled else 8.0)
        if not box.allows(took.get((role, compiled), default)):
            rows.append(row | {"skipped": f"time box ({box.left():.0f} s left)"})
            print_train_row(rows[-1])
            continue
        if compiled:
            torch._dynamo.reset()  # a fresh cache per config: recompile limits never apply across sizes
        started = time.perf_counter()
        contestants = [("petatrain", train_petatrain)] + ([] if deterministic else [("plain", train_plain)])
        if len(rows) % 2:  # who runs first alternates: a clock or cache that favours one order evens out
            contestants.reverse()
        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        for name, run in contestants:
            try:
                if deterministic:
                    loop._set_arithmetic(cfg, mode.device)  # what the worker loop sets before its first step
                row[name] = _throughput(run(mode, cfg), row, peak)
            except Exception as exc:
                row[name] = {"error": one_line(exc)}
            finally:
                torch.use_deterministic_algorithms(False)
                if workspace is None:  # the loop's cuBLAS setting, for its row only
                    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
                free(mode.device)
        took[(role, compiled)] = time.perf_counter() - started
        p, q = row.get("petatrain", {}), row.get("plain", {})
        if "tokens_per_s" in p and "tokens_per_s" in q:
            row["ratio"] = p["tokens_per_s"] / q["tokens_per_s"]
        rows.append(row)
        print_train_row(row)
    large = [
        r["petatrain"]["mfu"]
        for r in rows
        if r["model"] == mode.sizes["large"].label and r.get("petatrain", {}).get("mfu") and not r["deterministic"]
    ]
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    goals = {
        "ratio_min": min(ratios, default=None),
        "ratio_goal": GOALS["train_ratio"],
        "ratio_met": bool(ratios) and min(ratios) >= GOALS["train_ratio"],
        "mfu_large_best": max(large, default=None),
        "mfu_large_goal": GOALS["mfu_large"],
        "mfu_large_met": bool(large) and max(large) >= GOALS["mfu_large"],
    }
    return {"rows": rows, "peak_flops": peak, "peak_flops_source": peak_source, "goals": goals}


def _throughput(measured: dict[str, Any], row: dict[str, Any], peak: float | None) -> dict[str, Any]:
    step = measured["step_s"]
    out = measured | {"tokens_per_s": row["tokens_per_step"] / step}
    if peak:
        out["mfu"] = row["model_flops_per_step"] / step / peak
        out["hfu"] = row["executed_flops_per_step"] / step / peak  # with recomputation, causal attention halved
    return out


def print_train_header() -> None:
    print(
        f"{'model':>6} {'recompute':>9} {'compile':>8} {'petatrain tok/s':>16} {'MFU':>6} "
        f"{'plain tok/s':>12} {'MFU':>6} {'ratio':>6} {'GiB':>6} {'1st step s':>10}"
    )


def print_train_row(row: dict[str, Any]) -> None:
    label = row["compile"] or ("det." if row["deterministic"] else "no")
    head = f"{row['model']:>6} {row['recompute']:>9} {label:>8}"
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}")
        return

    def side(r: dict[str, Any]) -> str:
        if "tokens_per_s" not in r:
            return f"{'-' if not r else 'failed':>16} {'-':>6}"
        return f"{r['tokens_per_s']:>16,.0f} {pct(r.get('mfu'), False):>6}"

    p = row.get("petatrain", {})
    gib = f"{p['peak_gib']:.1f}" if p.get("peak_gib") else "-"
    first = f"{p['first_step_s']:.1f}" if "first_step_s" in p else "-"
    ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
    print(f"{head} {side(p)} {side(row.get('plain', {}))} {ratio:>6} {gib:>6} {first:>10}")
    for name in ("petatrain", "plain"):
        if "error" in row.get(name, {}):
            print(f"{'':>6} {name} failed: {row[name]['error']}")


# -- part 2: the planner against measurements -------------------------------------------------------------

# (size, micro-batch, recompute, accumulation): every size, recompute off and on, one accumulating config.
PLAN_CONFIGS = [
    ("small", 8, "none", 1),
    ("small", 16, "full", 1),
    ("medium", 4, "none", 2),
    ("medium", 8, "full", 1),
    ("large", 4, "none", 1),
    ("large", 8, "full", 1),
]


def part_plan(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """`profile` (plan/profile.py) runs the step and holds the plan's estimate to it; the errors are its
    own, the memory one less what the process held before (the previous rows' caches are emptied)."""
    calibration = tempfile.mkdtemp(prefix="gpu-check-calibration-")  # no stale calibration steers the estimate
    rows: list[dict[str, Any]] = ctx.setdefault("progress", [])  # kept if the part is cut short
    took: dict[str, float] = {}
    for role, micro, recompute, accumulation in PLAN_CONFIGS:
        size = mode.sizes[role]
        if mode.smoke:
            micro = max(1, micro // 4)
        # The smoke in fp32: profile measures the CPU's matmul peak per config, seconds each in bf16 on 2 cores.
        precision = "fp32" if mode.smoke else "bf16-mixed"
        plan = PlanConfig(calibration_dir=calibration)
        cfg = job(size, micro, accumulation=accumulation, recompute=recompute, precision=precision, plan=plan)
        name = f"{size.label} mb{micro}x{accumulation} {recompute}"
        if not box.allows(took.get(role, 3.0 if mode.smoke else 12.0)):
            rows.append({"config": name, "skipped": f"time box ({box.left():.0f} s left)"})
            print_plan_row(rows[-1])
            continue
        started = time.perf_counter()
        try:
            free(mode.device)
            before = allocated(mode.device)
            report = profile(cfg, steps=3 if mode.smoke else 5, save=False)
            rows.append(plan_row(name, report, before))
        except Exception as exc:
            rows.append({"config": name, "error": one_line(exc)})
        finally:
            free(mode.device)
        took[role] = time.perf_counter() - started
        print_plan_row(rows[-1])
    calibrate(rows)
    shutil.rmtree(calibration, ignore_errors=True)
    done = [r for r in rows if "memory_error" in r]
    memory = [abs(r["memory_error"]) for r in done]
    steps = [abs(r["step_error_calibrated_same_model"]) for r in done if "step_error_calibrated_same_model" in r]
    goals = {
        "memory_worst": max(memory, default=None),
        "memory_goal": GOALS["plan_memory"],
        "memory_met": bool(memory) and max(memory) <= GOALS["plan_memory"],
        "step_worst_calibrated": max(steps, default=None),
        "step_worst_calibrated_on_the_first": max(
            (abs(r["step_error_calibrated_first"]) for r in done if "step_error_calibrated_first" in r), default=None
        ),
        "step_worst_catalog": max((abs(r["step_error"]) for r in done), default=None),
        "step_goal": GOALS["plan_step"],
        "step_met": bool(steps) and max(steps) <= GOALS["plan_step"],
    }
    return {"rows": rows, "goals": goals}


def plan_row(name: str, report: dict[str, Any], before: int) -> dict[str, Any]:
    measured, estimate = report["measured"], report["estimate"]
    memory = measured["peak_memory_bytes"] - before
    predicted = estimate["memory_bytes"]["total"]
    return {
        "config": name,
        "model": name.split()[0],
        "memory_measured_bytes": memory,
        "memory_method": report["memory_method"],
        "memory_estimate_bytes": predicted,
        "memory_peak_moment": estimate["memory_peak_moment"],
        "memory_error": error_of(predicted, memory),
        "step_measured_s": measured["step_time_s"],
        "step_estimate_s": estimate["step_time_s"],  # the catalog's default efficiency (no calibration)
        "step_error": error_of(estimate["step_time_s"], measured["step_time_s"]),
        "efficiency_assumed": estimate["efficiency"],
        "efficiency_measured": measured["efficiency"],
        "executed_flops_per_step": estimate["executed_flops_per_step"],
        "peak_flops": report["peak_flops"],
        "mfu": measured["mfu"],
        "time_split_s": measured["time_split_s"],
    }


def calibrate(rows: list[dict[str, Any]]) -> None:
    """Step time as `plan` predicts it once `profile` has calibrated the accelerator (its measured
    efficiency replaces the catalog's): calibrated on the other config of the same model (profile your
    model once, plan its micro-batch and recompute: the goal's figure), and on the first config only."""
    done = [r for r in rows if "memory_error" in r]
    for r in done:
        same = [o for o in done if o is not r and o["model"] == r["model"]]
        for key, source in (
            ("same_model", same[0] if same else None),
            ("first", done[0] if r is not done[0] else None),
        ):
            if source is None:
                continue
            predicted = r["executed_flops_per_step"] / (r["peak_flops"] * source["efficiency_measured"])
            r[f"step_estimate_calibrated_{key}_s"] = predicted
            r[f"step_error_calibrated_{key}"] = error_of(predicted, r["step_measured_s"])


def print_plan_row(row: dict[str, Any]) -> None:
    if "memory_error" not in row:
        print(f"{row['config']:<26} {row.get('error') or row.get('skipped')}")
        return
    print(
        f"{row['config']:<26} {row['memory_measured_bytes'] / 2**30:>9.2f} "
        f"{row['memory_estimate_bytes'] / 2**30:>9.2f} {pct(row['memory_error']):>7} "
        f"{1e3 * row['step_measured_s']:>9.1f} {1e3 * row['step_estimate_s']:>9.1f} "
        f"{pct(row['step_error']):>7}  {row['efficiency_measured']:>5.2f}  ({row['memory_peak_moment']})"
    )


# -- part 3: checkpoint stall ------------------------------------------------------------------------------


class _LoaderState:
    """The loader's resume state, as tiny as the real one."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "position": 0}


def trained(size: Size, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and the recipe's AdamW with its state filled, as after a step; gradients freed."""
    cfg = job(size, 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model, cfg.train).module
    optimizer = recipe.build_optimizer(model, cfg.train)
    for p in model.parameters():  # a fake gradient: the state's size matters, not its values
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def checkpoint_petatrain(model, optimizer, folder: Path, repeats: int, staging: str = "auto") -> dict[str, Any]:
    """The loop's own calls: `_snapshot` (into the buffers the loop keeps: staged on the GPU where it
    has room, else host copies into reused pinned buffers; `staging` is checkpoint.staging) and
    `CheckpointWriter.submit`; the stall is both, until the training's stream has done the copies.
    The first checkpoint allocates the buffers (reported apart); a 10 s interval lets each write
    finish before the next checkpoint (its time reported). After the last snapshot the weights change
    at once, as the next update would, while the writer still copies: the restored weights must be
    the snapshot's."""
    cfg = JobConfig(checkpoint=CheckpointConfig(staging=staging))
    parts: dict[int, dict] = {}
    commits: list[dict] = []
    writer = ckpt.CheckpointWriter(
        str(folder),
        None,
        report_part=lambda step, rank, files: parts.__setitem__(step, files),  # one rank: its files are all
        wait_parts=lambda step, world, timeout: parts.get(step),
        on_commit=commits.append,
        keep_last=1,
    )
    buffers, digest = loop.snapshot_buffers(cfg), loop._digest(cfg)
    device = next(model.parameters()).device
    stalls, writes, on_device = [], [], []
    try:
        for rep in range(1 + repeats):
            writer.wait()
            last = rep == repeats
            expected = [p.detach().clone() for p in model.parameters()] if last else []
            started = time.perf_counter()
            snapshot, _ = loop._snapshot(
                model, optimizer, _LoaderState(), writer, buffers, 100 * (rep + 1), 0, 1, cfg, digest
            )
            writer.submit(snapshot)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the training's stream, not the writer's
            stalls.append(time.perf_counter() - started)
            on_device.append(snapshot.pending is not None)
            del snapshot
            if last:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)  # the next update, while the writer copies
            writer.wait()
            if writer.error is not None:
                raise writer.error
            writes.append(writer.last_write_s)
    finally:
        writer.close()
    del buffers
    state_dicts = state_dicts_seconds(model, optimizer)
    restore_s, step = restore_petatrain(model, optimizer, folder, cfg)
    assert step == 100 * (1 + repeats), f"resumed from step {step}"
    changed = sum(not torch.equal(p, e) for p, e in zip(model.parameters(), expected, strict=True))
    if changed:
        raise AssertionError(f"{changed} restored tensors differ from the snapshot's")
    return {
        "stall_s": statistics.median(stalls[1:]),
        "first_stall_s": stalls[0],
        "stall_samples": stalls,
        "staged_on_device": on_device,
        "state_dicts_s": state_dicts,
        "background_s": statistics.median(writes),
        "bytes": commits[-1]["bytes"],
        "restore_s": restore_s,
    }


def state_dicts_seconds(model, optimizer, repeats: int = 5) -> dict[str, float]:
    """A snapshot's state dicts alone (the host's share of its stall): torch's `get_model_state_dict`
    and `get_optimizer_state_dict` each time, against the ones a snapshot keeps (`strategies.base.StateDicts`)."""
    from petatrain.train.strategies.base import StateDicts

    kept = StateDicts()
    kept.get(model, optimizer)
    times: dict[str, list[float]] = {"torch": [], "kept": []}
    for _ in range(repeats):
        for name, cache in (("torch", StateDicts()), ("kept", kept)):
            started = time.perf_counter()
            cache.get(model, optimizer)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(samples) for name, samples in times.items()}


def checkpoint_dcp(model, optimizer, folder: Path, repeats: int, *, pinned: bool) -> dict[str, Any]:
    """torch.distributed.checkpoint.async_save in one process without a process group (no_dist). Its
    default stager copies to fresh pageable memory before returning; `pinned`: a reused DefaultStager
    with pinned buffers and asynchronous staging, the stall then lasting until staging completes
    (the loop may not change the weights before). Restore: dcp.load into the state dicts, then set."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    stager = None
    kwargs = dcp_kwargs(dcp.async_save, no_dist=True)
    if pinned:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            raise TypeError(f"torch {torch.__version__}: dcp.async_save takes no async_stager")

        options = StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
        )
        stager = DefaultStager(options)
        kwargs["async_stager"] = stager
    stalls, backgrounds = [], []
    target, total = folder, repeats + (1 if pinned else 0)  # pinned: the first allocates the buffers
    try:
        for rep in range(total):
            target = folder / f"dcp-{rep}"
            started = time.perf_counter()
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            response = dcp.async_save(state, checkpoint_id=str(target), **kwargs)
            staging = getattr(response, "staging_completion", None)
            if staging is not None:
                staging.result()
            stalls.append(time.perf_counter() - started)
            getattr(response, "upload_completion", response).result()
            backgrounds.append(time.perf_counter() - started)
            del state
            if rep < total - 1:  # the last is restored
                shutil.rmtree(target)
    finally:
        if stager is not None:
            stager.close()
    timed = stalls[1:] if pinned else stalls
    started = time.perf_counter()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(target), **dcp_kwargs(dcp.load, no_dist=True))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    restore_s = time.perf_counter() - started
    return {
        "stall_s": statistics.median(timed),
        "stall_samples": stalls,
        "background_s": statistics.median(backgrounds),
        "restore_s": restore_s,
    }


def checkpoint_torch_save(model, optimizer, folder: Path) -> dict[str, Any]:
    started = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, folder / "checkpoint.pt")
    stall = time.perf_counter() - started
    return {"stall_s": stall, "restore_s": restore_torch_load(model, optimizer, folder)}


def largest_fitting(mode: Mode, work: Path) -> dict[str, dict[str, Any]]:
    """Which sizes' checkpoints fit here: two on disk (retention keeps the previous one until the next
    commits), the training state four times over on the GPU (weights, gradients, AdamW's two), its
    pinned host copy in half the host memory."""
    disk = shutil.disk_usage(work).free
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = torch.cuda.get_device_properties(mode.device).total_memory if mode.device.type == "cuda" else host
    verdicts = {}
    for size in [mode.sizes["large"], *([] if mode.smoke else GPU_LARGER)]:
        state = 12 * size.params  # fp32 weights + AdamW
        why = []
        if 2 * state > 0.9 * disk:
            why.append(f"two checkpoints need {2 * state / 2**30:.0f} GiB of disk, {disk / 2**30:.0f} GiB free")
        if 16 * size.params > 0.9 * gpu:
            why.append(f"training state {16 * size.params / 2**30:.0f} GiB > 90% of the GPU's")
        if state > 0.5 * host:
            why.append(f"pinned host copy {state / 2**30:.0f} GiB > half the host memory")
        verdicts[size.label] = {"fits": not why, "why_not": "; ".join(why), "size": size}
    return verdicts


CheckpointPeer = Callable[[torch.nn.Module, torch.optim.Optimizer, Path], dict[str, Any]]


def checkpoint_peers(mode: Mode) -> list[tuple[str, CheckpointPeer, int]]:
    """(name, run, checkpoint files it writes) in the order they run: what the time box cuts is last."""
    repeats = 2 if mode.smoke else 1
    return [
        ("petatrain", lambda m, o, f: checkpoint_petatrain(m, o, f, repeats), 1 + repeats),
        ("dcp async_save, pinned stager", lambda m, o, f: checkpoint_dcp(m, o, f, 1, pinned=True), 2),
        ("petatrain, host copies", lambda m, o, f: checkpoint_petatrain(m, o, f, repeats, "copy"), 1 + repeats),
        ("torch.save", checkpoint_torch_save, 1),
        ("dcp async_save", lambda m, o, f: checkpoint_dcp(m, o, f, 1, pinned=False), 1),
    ]


def run_peer(name: str, run: CheckpointPeer, model, optimizer, work: Path) -> dict[str, Any]:
    """One peer's checkpoints into a folder of their own, removed after; its failure in one line."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-ckpt-", dir=work))
    try:
        row = run(model, optimizer, folder)
        row["percent_of_interval"] = 100 * row["stall_s"] / INTERVAL_S
    except Exception as exc:
        row = {"error": one_line(exc)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_checkpoint_row(name, row)
    return row


def part_checkpoint(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """The large model's checkpoints by every peer, then petatrain's at the larger sizes that fit."""
    size, work = mode.sizes["large"], Path(ctx["work"])
    fits = largest_fitting(mode, work)
    if not fits[size.label]["fits"]:
        raise RuntimeError(f"{size.label} does not fit: {fits[size.label]['why_not']}")
    model, optimizer = trained(size, mode.device)
    nbytes = state_bytes(model, optimizer)
    write_s = nbytes / 1.5e9 + 1.0  # one checkpoint written at ~1.5 GB/s, then read back to checksum it
    rows: dict[str, dict[str, Any]] = ctx.setdefault("progress", {})  # kept if the part is cut short
    for name, run, writes in checkpoint_peers(mode):
        if name.endswith("pinned stager") and mode.device.type != "cuda":
            rows[name] = {"not_applicable": "pinned staging needs CUDA"}
        elif not box.allows(writes * write_s):
            rows[name] = {"skipped": f"time box ({box.left():.0f} s left)"}
        else:
            rows[name] = run_peer(name, run, model, optimizer, work)
            free(mode.device)
            continue
        print_checkpoint_row(name, rows[name])
    del model, optimizer
    free(mode.device)
    for label, verdict in fits.items():
        larger: Size = verdict.pop("size")
        if label == size.label or not verdict["fits"]:
            continue
        if not box.allows(3 * (16 * larger.params / 1.5e9 + 1.0)):
            verdict["skipped"] = f"time box ({box.left():.0f} s left)"
            continue
        model, optimizer = trained(larger, mode.device)
        rows[f"petatrain {label}"] = run_peer(
            f"petatrain {label}", checkpoint_peers(mode)[0][1], model, optimizer, work
        )
        del model, optimizer
        free(mode.device)
    share = rows.get("petatrain", {}).get("stall_s")
    goals = {
        "share_of_interval": share / INTERVAL_S if share is not None else None,
        "goal": GOALS["checkpoint_share"],
        "met": share is not None and share / INTERVAL_S <= GOALS["checkpoint_share"],
    }
    return {
        "model": size.label,
        "state_bytes": nbytes,
        "interval_s": INTERVAL_S,
        "storage": storage_of(work),
        "largest_fitting": fits,
        "rows": rows,
        "goals": goals,
    }


def print_checkpoint_row(name: str, row: dict[str, Any]) -> None:
    if "stall_s" not in row:
        print(f"{name:<32} {row.get('error') or row.get('skipped') or row.get('not_applicable')}")
        return
    background = f"{row['background_s']:.2f}" if "background_s" in row else "-"
    print(
        f"{name:<32} {row['stall_s']:>9.3f} {row['percent_of_interval']:>9.3f}% {background:>11} "
        f"{row['restore_s']:>10.2f}"
    )
    if "state_dicts_s" in row:
        sd = row["state_dicts_s"]
        print(
            f"{'':<4}its state dicts: {1e3 * sd['torch']:.1f} ms from torch each time, {1e3 * sd['kept']:.1f} ms kept"
        )


# -- part 4: the loader feeding the GPU ----------------------------------------------------------------------


def write_token_dataset(url: str, *, rows: int, row_tokens: int, vocab: int, shard_rows: int) -> dict[str, Any]:
    """A packed-token dataset exactly as ingest writes one, with random ids: shards of one required
    fixed-width `tokens` column in one data page (data/ingest/stages.py's layout), the shard index, then the
    manifest, committed last (data/index.py). Ingest runs on Ray; its writers do not."""
    from petatrain.data import index as idx
    from petatrain.data.ingest.stages import encode_parquet, shard_layout
    from petatrain.data.manifest import Column, Lineage, Manifest, TokenizerInfo, Totals
    from petatrain.storage import atomic_write, join

    rng = np.random.default_rng(0)
    dtype = np.dtype("uint16")  # the loader's dtype for a vocabulary below 65536 (index.token_dtype)
    width = row_tokens * dtype.itemsize
    idx.mark_folder(url)
    shards, kind = [], pa.binary(width)
    for shard, start in enumerate(range(0, rows, shard_rows)):
        n = min(shard_rows, rows - start)
        ids = rng.integers(0, vocab, size=(n, row_tokens), dtype=dtype)
        column = pa.FixedSizeBinaryArray.from_buffers(kind, n, [None, pa.py_buffer(ids.tobytes())])
        table = pa.table([column], schema=pa.schema([pa.field("tokens", kind, nullable=False)]))
        path = f"data/part-{shard:06d}.parquet"
        checksum, size = atomic_write(join(url, path), encode_parquet(table, **shard_layout(table)))
        shards.append({"path": path, "rows": n, "bytes": size, "checksum": checksum})
    total = sum(s["bytes"] for s in shards)
    manifest = Manifest(
        kind="packed",
        schema=[Column("tokens", str(kind))],
        totals=Totals(
            shards=len(shards), rows=rows, bytes=total, documents=rows, rows_in=rows, tokens=rows * row_tokens
        ),
        index=idx.append_shards(url, None, shards),
        ingest={"tokenizer": "synthetic", "pack_length": row_tokens},
        tokenizer=TokenizerInfo(vocab_size=vocab, dtype=dtype.name, spec="synthetic"),
        lineage=Lineage(),
    )
    idx.commit_manifest(url, manifest, None)
    return {"rows": rows, "shards": len(shards), "bytes": total}


def part_loader(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """The medium model trained by the loop's step from the loop's data (`TokenBatches`: the streaming
    loader's micro-batches, its `wait_s` the loop's data-wait), against the same steps from memory."""
    from petatrain.train.batches import TokenBatches

    box.need(3.0 if mode.smoke else 20.0)
    size, device = mode.sizes["medium"], mode.device
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-data-", dir=ctx["work"]))
    try:
        row_tokens = size.seq_len + 1
        rows = mode.dataset_mb * 10**6 // (2 * row_tokens)
        started = time.perf_counter()
        dataset = write_token_dataset(
            str(folder), rows=rows, row_tokens=row_tokens, vocab=size.vocab, shard_rows=max(64, rows // 10)
        )
        dataset["write_s"] = time.perf_counter() - started
        cfg = job(size, size.micro, data=DataConfig(dataset=str(folder), eval_shards=1))
        data = TokenBatches(cfg, rank=0, world=1, micro=size.micro, options=None)
        memory = RandomTokens(cfg, device)
        steps = 3 * mode.steps
        fed = feed(mode, cfg, data.next, lambda: data.wait_s, steps)
        free(device)  # the first model's memory
        from_memory = feed(mode, cfg, memory.next, lambda: 0.0, steps)
        capacity = loader_capacity(data, seconds=1.0 if mode.smoke else 2.0)
        with contextlib.suppress(Exception):
            data._it.close()  # the loader's prefetch threads stop here, not in the next part's time
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        free(device)
    share = fed["data_wait_s"] / fed["elapsed_s"]
    slower = fed["step_s"] / from_memory["step_s"] - 1
    print(
        f"{size.label} mb{size.micro}: step {1e3 * fed['step_s']:.1f} ms from the loader, "
        f"{1e3 * from_memory['step_s']:.1f} ms from memory ({pct(slower)}); data-wait {pct(share, False)} of the "
        f"step; the loader alone: {capacity['tokens_per_s']:,.0f} tokens/s "
        f"({capacity['tokens_per_s'] / (size.micro * size.seq_len / fed['step_s']):.0f}x what training takes)"
    )
    return {
        "model": size.label,
        "micro_batch": size.micro,
        "dataset": dataset | {"storage": storage_of(ctx["work"])},
        "from_loader": fed,
        "from_memory": from_memory,
        "data_wait_share": share,
        "step_slower_than_memory": slower,
        "loader_alone": capacity,
        "goals": {"data_wait_share": share, "goal": GOALS["loader_wait"], "met": share < GOALS["loader_wait"]},
    }


def feed(mode: Mode, cfg: JobConfig, next_batch: Callable, wait_s: Callable[[], float], steps: int) -> dict[str, Any]:
    """`steps` timed steps of the loop's step (after warm-up), each batch from `next_batch`."""
    device = mode.device
    step, _ = loop_step(mode, cfg, next_batch)
    for i in range(mode.warmup):
        step(i)
    sync(device)
    wait0, started = wait_s(), time.perf_counter()
    for i in range(steps):
        step(mode.warmup + i)
    sync(device)
    elapsed = time.perf_counter() - started
    return {"steps": steps, "elapsed_s": elapsed, "step_s": elapsed / steps, "data_wait_s": wait_s() - wait0}


def loader_capacity(data: Any, seconds: float) -> dict[str, float]:
    """Micro-batches the loader hands out per second when nothing else runs."""
    batches, started = 0, time.perf_counter()
    tokens = 0
    while time.perf_counter() - started < seconds:
        tokens += data.next().numel()
        batches += 1
    elapsed = time.perf_counter() - started
    return {"batches_per_s": batches / elapsed, "tokens_per_s": tokens / elapsed}


# -- part 5: the serving engine ----------------------------------------------------------------------------


class _NoText:
    """The engine's tokenizer, for ids that no tokenizer made: no text."""

    def decode(self, ids: list[int]) -> str:
        return ""


@torch.no_grad()
def decode_cached(model: Any, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """The model's KV cache as the engine drives it (each prompt prefilled into its row, then one decode
    of every row per token), greedy on the device: the engine less its host-side sampling."""
    cache = model.new_cache(prompts.size(0))
    logits = torch.stack([model.prefill(p, cache, row) for row, p in enumerate(prompts)])
    out = [logits.argmax(-1)]
    for _ in range(new - 1):
        out.append(model.decode(out[-1], cache).argmax(-1))
    return torch.stack(out, 1)


@torch.no_grad()
def decode_recompute(model: Any, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """No cache: the whole prefix through the model for every token (train/sample.py's `generate`), batched."""
    x, seq_len = prompts, model.cfg.seq_len
    for _ in range(new):
        nxt = model(x[:, -seq_len:])[:, -1].argmax(-1, keepdim=True)
        x = torch.cat([x, nxt], 1)
    return x[:, prompts.size(1) :]


def part_serve(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """Greedy completions of random prompts with the medium model in fp32 (as serve loads a run's weights)."""
    from petatrain.serve.engine import Engine, Request

    box.need(2.0 if mode.smoke else 10.0)
    size, device = mode.sizes["medium"], mode.device
    prompt, new = mode.decode
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(size.model()).module.eval()
    engine = Engine(model, _NoText())  # token ids go where the model is; sampling on the host
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = ctx.setdefault("progress", [])  # kept if the part is cut short
    for batch in mode.serve_batches:
        prompts = torch.randint(0, size.vocab, (batch, prompt), generator=gen)
        requests = [Request(ids=tuple(p.tolist()), max_tokens=new, temperature=0.0) for p in prompts]
        on_device = prompts.to(device)
        runs: dict[str, Callable[[], Any]] = {
            "engine": lambda requests=requests: engine.complete(requests),
            "kv_cache": lambda p=on_device: decode_cached(model, p, new),
            "recompute": lambda p=on_device: decode_recompute(model, p, new),
        }
        row: dict[str, Any] = {"batch": batch, "prompt_tokens": prompt, "new_tokens": new}
        for name, run in runs.items():
            if not box.allows(1.0):
                row[name] = {"skipped": f"time box ({box.left():.0f} s left)"}
                continue
            try:
                row[name] = {"tokens_per_s": batch * new / best_of(run, device, 1 if batch > 1 else 2)}
            except Exception as exc:
                row[name] = {"error": one_line(exc)}
        rows.append(row)
        print_serve_row(row)
    sampled = serve_sampling(engine, size, mode, box)
    return {
        "model": size.label,
        "dtype": "float32",
        "greedy": True,
        "engine": "serve.engine.Engine as serve runs it, the model on the device",
        "rows": rows,
        "engine_sampled_batch_32": sampled,
    }


def serve_sampling(engine: Any, size: Size, mode: Mode, box: Box) -> dict[str, Any] | None:
    """The engine at temperature 1 (its default: a float64 softmax and a draw per row on the host) at the
    largest batch, against its greedy figure: what sampling on the host costs."""
    from petatrain.serve.engine import Request

    if not box.allows(2.0):
        return None
    prompt, new = mode.decode
    batch = mode.serve_batches[-1]
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, size.vocab, (batch, prompt), generator=gen)
    requests = [Request(ids=tuple(p.tolist()), max_tokens=new, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    try:
        return {"tokens_per_s": batch * new / best_of(lambda: engine.complete(requests), mode.device, 1)}
    except Exception as exc:
        return {"error": one_line(exc)}


def best_of(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of `repeats` runs after one untimed (kernels, allocator, caches)."""
    run()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def print_serve_row(row: dict[str, Any]) -> None:
    def cell(r: dict[str, Any]) -> str:
        return f"{r['tokens_per_s']:>12,.0f}" if "tokens_per_s" in r else f"{(r.get('error') or r['skipped'])[:30]:>12}"

    kv, re = row["kv_cache"], row["recompute"]
    speedup = (
        f"{kv['tokens_per_s'] / re['tokens_per_s']:.1f}x" if "tokens_per_s" in kv and "tokens_per_s" in re else "-"
    )
    print(f"{row['batch']:>6} {cell(row['engine'])} {cell(kv)} {cell(re)} {speedup:>9}")


# -- part 6: layer profile -> partition -------------------------------------------------------------------


def part_partition(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """`profile --layers` (train.pipeline.costs.measure: each unit timed inside whole passes) on this
    device, the partitioner's cut into 4 stages (`profile` partition, plan/pipeline.py), then each
    stage's forward + backward of one micro-batch run alone, one stage after another on this device."""
    from petatrain.plan.pipeline import compare
    from petatrain.train.pipeline import costs

    box.need(1.0 if mode.smoke else 8.0)
    size, device = mode.sizes["medium"], mode.device
    micro = size.micro // 2
    stages = 4
    cfg = job(
        size,
        micro,
        accumulation=2 * stages,
        parallel=ParallelConfig(strategy="pipeline", workers=str(stages), pipeline=PipelineConfig(stages=stages)),
    )
    threads = torch.get_num_threads()
    try:
        layer_profile = costs.measure(cfg, micro, device, repetitions=3 if mode.smoke else 5)
    finally:
        torch.set_num_threads(threads)  # measure takes the CPU rank's share of cores
    chosen = next(p for p in compare(cfg, layer_profile, micro) if p["partition"] == "profile")
    starts = chosen["starts"]
    predicted = costs.stage_seconds(layer_profile, starts, micro)
    measured = measure_stages(cfg, micro, starts, device, repeats=3 if mode.smoke else 7)
    rows = []
    for k, stage in enumerate(chosen["stages"]):
        row = {"stage": k, "units": stage["units"], "predicted_s": predicted[k], "measured_s": measured[k]}
        row["error"] = error_of(predicted[k], measured[k])
        rows.append(row)
        print(
            f"{k:>6} {stage['units']:<22} {1e3 * predicted[k]:>10.2f} {1e3 * measured[k]:>10.2f} {pct(row['error']):>8}"
        )
    worst = max(abs(r["error"]) for r in rows)
    free(device)
    return {
        "model": size.label,
        "micro_batch": micro,
        "stages": stages,
        "starts": starts,
        "units": layer_profile.units,
        "unit_seconds": layer_profile.seconds,
        "rows": rows,
        "goals": {"worst": worst, "goal": GOALS["partition"], "met": worst <= GOALS["partition"]},
    }


def measure_stages(cfg: JobConfig, micro: int, starts: list[int], device: torch.device, repeats: int) -> list[float]:
    """Median seconds of each stage's forward + backward on one micro-batch: the embedding (first
    unit) from tokens, blocks from a hidden state, the last stage through the loss; a stage's backward
    starts from a gradient of its output, as the next stage would send it."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        spec = build_model(cfg.model, cfg.train)
    module: Any = spec.module.train()
    assert spec.pipeline is not None
    blocks = list(getattr(module, spec.pipeline.blocks))
    n_units = len(blocks) + 2
    m = cfg.model
    tokens = torch.randint(0, m.vocab_size, (micro, m.seq_len + 1), device=device)
    amp = recipe.autocast(cfg.train, device)
    ends = [*starts[1:], n_units]
    # What the neighbours would send, made before the clock starts: the residual stream (fp32 under
    # autocast) coming in, the gradient of the stage's output going back.
    hidden = torch.randn(micro, m.seq_len, m.d_model, device=device)
    gradient = torch.randn(micro, m.seq_len, m.d_model, device=device)

    def stage(a: int, b: int) -> None:
        with amp:
            x = module.embed(tokens[:, :-1]) if a == 0 else hidden.detach().requires_grad_()
            for unit in range(max(a, 1), min(b, n_units - 1)):
                x = module.run_block(blocks[unit - 1], x)
            if b == n_units:
                x = spec.pipeline.output_loss(module.finish(x), tokens[:, 1:])
        if b == n_units:
            x.backward()
        else:
            x.backward(gradient)

    out = []
    for a, b in zip(starts, ends, strict=True):
        samples = []
        for rep in range(3 + repeats):
            sync(device)
            started = time.perf_counter()
            stage(a, b)
            sync(device)
            if rep >= 3:
                samples.append(time.perf_counter() - started)
            module.zero_grad(set_to_none=True)
        out.append(statistics.median(samples))
    return out


# -- the run ---------------------------------------------------------------------------------------------


# -- part 7: communication per mesh dimension ------------------------------------------------------------


def part_comm(mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """Two traced steps (train.trace.StepTracer, as `observe.profile_at` runs it) of all-reduces on two
    groups named as a DeviceMesh names its dimensions' (a mesh of one rank would reuse the default
    group for both), 64 MiB a step on `data` and four of 1 MiB on `tensor`, in a process group of this
    one process: NCCL on the GPU (TORCH_NCCL_ENABLE_TIMING=1 set before it starts, so that its recorder
    times them), gloo in the smoke. What comes back is the summary's `communication_by_dimension`, as
    the report's mesh table shows it."""
    import socket

    import torch.distributed as dist

    from petatrain.train.trace import FLIGHT_RECORDERS, StepTracer

    box.need(5.0)
    device, cuda = mode.device, mode.device.type == "cuda"
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        import torch._C._distributed_c10d as c10d

        groups = {name: dist.new_group([0], group_desc=f"mesh_{name}") for name in ("dp", "tp")}
        big = torch.ones((64 if cuda else 4) * 2**20 // 4, device=device)
        small = torch.ones(2**20 // 4, device=device)
        folder = tempfile.mkdtemp(prefix="gpu-comm-", dir=ctx["work"])
        tracer = StepTracer(2, 2, rank=0, attempt=0, run_url=folder)
        for step in range(1, 4):
            tracer.before(step)
            dist.all_reduce(big, group=groups["dp"])
            for _ in range(4):
                dist.all_reduce(small, group=groups["tp"])
            sync(device)
            if cuda and step == 3:  # NCCL's watchdog marks a collective's end on its rounds: let it see the last
                time.sleep(1.0)
            tracer.after(step)
        summary = json.loads((Path(folder) / "traces" / "attempt-0" / "rank-0.summary.json").read_text())
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    comm = summary.get("communication_by_dimension") or {}
    figures = {
        "backend": "nccl" if cuda else "gloo",
        "recorders": [name for name in FLIGHT_RECORDERS if hasattr(c10d, name)],
        "nccl_timing": os.environ.get("TORCH_NCCL_ENABLE_TIMING"),
        "step_ms": summary.get("step_ms"),
        **comm,
    }
    for name, d in sorted((comm.get("dimensions") or {}).items()):
        ms = "-" if d.get("ms") is None else f"{d['ms']:.3f}"
        print(f"{name:<14} {d.get('calls')!s:>11} {d.get('mib')!s:>10} {ms:>10}")
    return figures


RUNNERS: dict[str, Callable[[Mode, Box, dict[str, Any]], dict[str, Any]]] = {
    "train": part_train,
    "plan": part_plan,
    "checkpoint": part_checkpoint,
    "loader": part_loader,
    "serve": part_serve,
    "partition": part_partition,
    "comm": part_comm,
}
TITLES = {
    "train": "train: tokens/s and MFU, petatrain's step vs a plain loop of the same model and optimizer",
    "plan": "plan: predicted vs measured (GiB peak tensors, ms per step; catalog efficiency)",
    "checkpoint": "checkpoint: stall per checkpoint (s, % of a 10 s interval), background write, restore (s)",
    "loader": "loader: the streaming loader feeding the medium model",
    "serve": "serve: greedy completion tokens/s (engine | KV cache on the device | recompute), speedup of the cache",
    "partition": "partition: per-stage forward + backward (ms), the partitioner's prediction vs measured",
    "comm": "comm: a traced step's communication per mesh dimension (collectives, MiB, ms a step)",
}
HEADERS: dict[str, Callable[[], None]] = {
    "train": print_train_header,
    "plan": lambda: print(
        f"{'config':<26} {'GiB meas':>9} {'GiB est':>9} {'err':>7} {'ms meas':>9} {'ms est':>9} {'err':>7} {'eff.':>5}"
    ),
    "checkpoint": lambda: print(f"{'peer':<32} {'stall s':>9} {'% of 10 s':>10} {'background':>11} {'restore s':>10}"),
    "loader": lambda: None,
    "serve": lambda: print(f"{'batch':>6} {'engine':>12} {'kv cache':>12} {'recompute':>12} {'kv/recomp':>9}"),
    "partition": lambda: print(f"{'stage':>6} {'units':<22} {'predicted':>10} {'measured':>10} {'error':>8}"),
    "comm": lambda: print(f"{'dimension':<14} {'collectives':>11} {'MiB':>10} {'ms':>10}"),
}


def run_part(name: str, mode: Mode, box: Box, ctx: dict[str, Any]) -> dict[str, Any]:
    """One part, its failure caught and recorded in one line; the next part runs regardless."""
    print(f"\n== {TITLES[name]}" + (f"  [{SMOKE_NOTE}]" if mode.smoke else ""), flush=True)
    HEADERS[name]()
    started = time.perf_counter()
    ctx.pop("progress", None)  # a part's rows so far (`ctx.setdefault("progress", ...)`), kept if it fails
    try:
        figures = RUNNERS[name](mode, box, ctx)
        result: dict[str, Any] = {"status": "ok", "figures": figures}
        if _has_row_errors(figures):
            result["status"] = "partial"
    except BudgetExceeded:
        result = {"status": "error", "error": "BudgetExceeded: the run's time budget ran out during this part"}
    except Exception as exc:
        result = {"status": "error", "error": one_line(exc)}
        print(f"  failed: {result['error']}")
    finally:
        with contextlib.suppress(Exception):
            free(mode.device)
    if result["status"] == "error" and ctx.get("progress"):
        result["figures"] = {"rows": ctx["progress"], "cut_short": True}
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["time_box_s"] = round(box.seconds, 1)
    return result


def _has_row_errors(value: Any) -> bool:
    """Whether a row of a part's figures failed or was cut by the time box (a partial part)."""
    if isinstance(value, dict):
        if isinstance(value.get("error"), str) or "skipped" in value:
            return True
        return any(_has_row_errors(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_row_errors(v) for v in value)
    return False


def describe_machine(mode: Mode) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    out: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": "cpu",
    }
    if mode.device.type == "cuda":
        props = torch.cuda.get_device_properties(mode.device)
        out |= {
            "device": torch.cuda.get_device_name(mode.device),
            "device_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cudnn": torch.backends.cudnn.version(),
            "catalog_name": catalog_name(torch.cuda.get_device_name(mode.device)),
        }
    # Where each library came from: the carried wheels (/tmp/site) or the machine's own.
    out["packages"] = {}
    for module, dist in (
        ("numpy", "numpy"),
        ("pyarrow", "pyarrow"),
        ("fsspec", "fsspec"),
        ("cryptography", "cryptography"),
        ("google_crc32c", "google-crc32c"),
        ("safetensors", "safetensors"),
        ("xxhash", "xxhash"),
        ("yaml", "PyYAML"),
        ("tokenizers", "tokenizers"),
    ):
        try:
            path = importlib.import_module(module).__file__ or ""
            out["packages"][dist] = {"version": version(dist), "from": str(Path(path).parent.parent)}
        except Exception as exc:
            out["packages"][dist] = {"error": one_line(exc)}
    return out


def peak_flops(mode: Mode) -> tuple[float | None, str]:
    """The bf16 dense peak MFU is measured against: the catalog's for this GPU; the smoke measures the CPU's."""
    if mode.smoke:
        return measure_cpu_matmul_peak(torch.bfloat16, n=512), "measured CPU bf16 matmul (smoke)"
    name = torch.cuda.get_device_name(mode.device)
    accelerator = catalog_name(name)
    if accelerator is None:
        return None, f"{name!r} is not in the accelerator catalog: no MFU"
    return load_catalog()[accelerator].peak_flops("bf16-mixed"), f"catalog {accelerator}, bf16 dense"


def box_for(name: str, remaining: list[str], left_s: float) -> Box:
    """A part's time box: its share of what is left among the parts still to run (a part that ends
    early leaves its time to the later ones)."""
    return Box(left_s * SHARES[name] / sum(SHARES[p] for p in remaining))


def result_path(out: Path, machine: dict[str, Any], smoke: bool) -> Path:
    device = "cpu-smoke" if smoke else machine.get("catalog_name") or machine["device"]
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in device)
    return out / f"gpu-{safe}.json"


def summary(record: dict[str, Any]) -> list[str]:
    """One line per goal: its figure, the goal, met or not (the smoke's are not judged)."""
    lines = []
    parts = record["parts"]
    judged = not record["smoke"]

    def verdict(met: bool | None) -> str:
        return ("met" if met else "MISSED") if judged else "not judged (smoke)"

    def goals(name: str) -> dict[str, Any] | None:
        part = parts.get(name, {})
        return part.get("figures", {}).get("goals") if part.get("figures") else None

    if g := goals("train"):
        ratio = f"{g['ratio_min']:.3f}" if g["ratio_min"] is not None else "-"
        lines.append(f"train: petatrain/plain at least {ratio} (>= {g['ratio_goal']}): {verdict(g['ratio_met'])}")
        best = g["mfu_large_best"]
        lines.append(f"train: MFU at the large size {pct(best, False)} (>= 45%): {verdict(g['mfu_large_met'])}")
    if g := goals("plan"):
        lines.append(f"plan: memory worst |error| {pct(g['memory_worst'], False)} (<= 5%): {verdict(g['memory_met'])}")
        lines.append(
            f"plan: step worst |error| {pct(g['step_worst_calibrated'], False)} calibrated on the same model's "
            f"other config ({pct(g['step_worst_calibrated_on_the_first'], False)} on the first config only, "
            f"{pct(g['step_worst_catalog'], False)} with the catalog's efficiency) (<= 15%): {verdict(g['step_met'])}"
        )
    if g := goals("checkpoint"):
        share = g["share_of_interval"]
        text = f"{100 * share:.3f}%" if share is not None else "-"
        lines.append(f"checkpoint: petatrain stall {text} of 10 s (<= 0.1%): {verdict(g['met'])}")
    if g := goals("loader"):
        share = g["data_wait_share"]
        lines.append(f"loader: data-wait {100 * share:.2f}% of the step (< 1%): {verdict(g['met'])}")
    if g := goals("partition"):
        lines.append(f"partition: worst stage |error| {pct(g['worst'], False)} (<= 10%): {verdict(g['met'])}")
    for name, part in parts.items():
        if part.get("status") == "error":
            lines.append(f"{name}: FAILED: {part['error']}")
        elif part.get("status") == "partial":
            lines.append(f"{name}: partial: a row failed or its time box cut it (see its table)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for gpu-<device>.json (default benchmarks/results; smoke: a temp folder)")
    parser.add_argument("--only", action="append", choices=PARTS, help="run this part (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="every part on the CPU at tiny sizes: checks the code")
    parser.add_argument("--budget", type=float, help=f"seconds for all parts (GPU {GPU_BUDGET_S:.0f})")
    parser.add_argument("--work", default=tempfile.gettempdir(), help="scratch folder (checkpoints, the dataset)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: --smoke runs the parts on the CPU at tiny sizes (not a GPU figure)")
    mode = Mode.for_run(args.smoke)
    if mode.smoke:  # tiny kernels: two threads' barriers on a shared 2-core machine cost more than the work
        torch.set_num_threads(1)
    budget = args.budget or (SMOKE_BUDGET_S if args.smoke else GPU_BUDGET_S)
    selected = [p for p in PARTS if p in (args.only or PARTS)]
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpu-smoke-")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(int(budget + ALARM_MARGIN_S))  # the part running then stops, the rest are skipped
    machine = describe_machine(mode)
    peak, peak_source = peak_flops(mode)
    ctx = {"peak_flops": peak, "peak_source": peak_source, "work": args.work}
    record: dict[str, Any] = {
        "benchmark": "gpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "smoke": args.smoke,
        "note": SMOKE_NOTE if args.smoke else "one GPU, one process, petatrain's Ray-free layers",
        "machine": machine,
        "budget_s": budget,
        "goals": GOALS,
        "parts": {},
    }
    path = result_path(out, machine, args.smoke)
    print(f"{machine['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}; peak: {peak_source}")
    for i, name in enumerate(selected):
        left = budget - (time.perf_counter() - started)
        if left <= 0:
            record["parts"][name] = {"status": "error", "error": "BudgetExceeded: skipped, no time left"}
        else:
            record["parts"][name] = run_part(name, mode, box_for(name, selected[i:], left), ctx)
        record["seconds"] = round(time.perf_counter() - started, 1)
        record["ray_imported"] = sys.modules.get("ray") is not None
        path.write_text(json.dumps(record, indent=2, default=float) + "\n")  # after every part: a kill keeps them
    signal.alarm(0)
    record["summary"] = summary(record)
    path.write_text(json.dumps(record, indent=2, default=float) + "\n")
    print(f"\n== summary ({record['seconds']:.0f} s)" + (f"  [{SMOKE_NOTE}]" if mode.smoke else ""))
    for line in record["summary"]:
        print(f"  {line}")
    print(f"wrote {path}")
    return 0


def _out_of_time(signum: int, frame: Any) -> None:
    raise BudgetExceeded


if __name__ == "__main__":
    sys.exit(main())
