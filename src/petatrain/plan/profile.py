"""`petatrain profile`: run real training steps here, measure them, hold the plan's estimate to them.

One process, the configured model (models.build_model) and the step `train` runs
(train.recipe: its optimizer and parameter groups, learning rate, micro-batching, loss,
gradient clipping), the full global batch as gradient-accumulation micro-batches. Measured:

- peak memory: on a GPU `torch.cuda.max_memory_allocated`; on the CPU torch's own
  `MemTracker` (torch.distributed._tools) around one extra real step. MemTracker is a
  dispatch mode that follows every tensor storage from allocation to free, which is
  exactly the quantity the estimate models (live tensor bytes). RSS would add the
  allocator's caching and the Python heap, and tracemalloc does not see torch's
  allocations at all;
- step time split into data wait / forward / backward / optimizer / communication (one
  process has no collectives: 0, reported as such);
- FLOPs per step with plan.flops.FlopCounter, achieved FLOP/s, MFU against the
  accelerator's dense peak (on the CPU against a measured matmul peak);
- the verdict: data-, communication-, memory- or compute-bound.

The calibration it saves (plan.calibration) carries the achieved efficiency, which the
next `petatrain plan` uses instead of the catalog default for that accelerator.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

import torch

from petatrain.config import JobConfig
from petatrain.cost.calibration import Calibration, load_calibrations, save_calibration
from petatrain.errors import ConfigError
from petatrain.models import build_model
from petatrain.plan import estimate as est
from petatrain.plan import tensor_profile
from petatrain.plan.catalog import load_catalog
from petatrain.plan.flops import FlopCounter
from petatrain.train import recipe

log = logging.getLogger(__name__)

CPU_DEFAULT_EFFICIENCY = 0.5  # executed FLOP/s over the measured matmul peak, before any calibration

# torch.cuda device names -> catalog names (first match wins).
_GPU_NAMES = (
    ("H100 PCIe", "H100-PCIe"),
    ("H100", "H100-SXM"),
    ("H200", "H200"),
    ("B200", "B200"),
    ("A100-SXM4-40GB", "A100-40GB"),
    ("A100-PCIE-40GB", "A100-40GB"),
    ("A100", "A100-80GB"),
    ("L40S", "L40S"),
    ("L4", "L4"),
    ("A10G", "A10G"),
    ("MI300X", "MI300X"),
)


def catalog_name(device_name: str) -> str | None:
    for needle, name in _GPU_NAMES:
        if needle.lower() in device_name.lower():
            return name
    return None


def measure_cpu_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of an n×n matmul on this CPU: the peak CPU efficiency is measured against."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Batches:
    """Random tokens, or the configured dataset through the streaming loader."""

    def __init__(self, cfg: JobConfig, device: torch.device, use_dataset: bool):
        self.cfg, self.device = cfg, device
        m, tr = cfg.model, cfg.train
        self.shape = (tr.micro_batch, m.seq_len + 1)
        self.gen = torch.Generator().manual_seed(tr.seed)
        self.it = None
        if use_dataset:
            from petatrain.data import loader

            self.it = iter(loader(cfg.data.dataset, batch_size=tr.micro_batch, columns=["tokens"], seed=cfg.data.seed))

    def next(self) -> torch.Tensor:
        if self.it is None:
            tokens = torch.randint(0, self.cfg.model.vocab_size, self.shape, generator=self.gen)
        else:
            try:
                tokens = next(self.it)["tokens"].long()
            except StopIteration:
                raise ConfigError("profile: the dataset ran out of batches; use fewer --steps") from None
            if tokens.shape[1] < self.shape[1]:
                raise ConfigError(
                    f"profile: dataset rows hold {tokens.shape[1]} tokens, model.seq_len + 1 = {self.shape[1]} needed"
                )
            tokens = tokens[:, : self.shape[1]]
        return tokens.to(self.device, non_blocking=True)


class TrainStep:
    """The step `train` runs (train.recipe: optimizer and parameter groups, learning rate,
    micro-batching, loss, clipping), in one process, timed phase by phase."""

    def __init__(self, cfg: JobConfig, device: torch.device, batches: Any):
        tr = cfg.train
        torch.manual_seed(tr.seed)
        self.spec = build_model(cfg.model, tr)
        self.model = self.spec.module.to(device).train()
        self.optimizer = recipe.build_optimizer(self.model, tr)
        _, self.accumulation = recipe.micro_batching(tr, 1)
        self.cfg, self.device, self.batches = cfg, device, batches
        self.taken = 0

    def run(self, timings: dict[str, float] | None = None, before_micro_batch=None) -> torch.Tensor:
        """One optimizer step over the global batch; adds its phases' seconds to `timings`; the loss."""
        tr, device = self.cfg.train, self.device
        recipe.set_lr(self.optimizer, self.taken, tr)
        loss_sum = torch.zeros((), device=device)
        for _ in range(self.accumulation):
            if before_micro_batch is not None:
                before_micro_batch()
            t0 = time.perf_counter()
            tokens = self.batches.next()
            _sync(device)
            t1 = time.perf_counter()
            loss = recipe.micro_batch_loss(
                self.spec.loss_fn, self.model, tokens, self.accumulation, recipe.autocast(tr, device)
            )
            _sync(device)
            t2 = time.perf_counter()
            loss.backward()
            loss_sum += loss.detach().float()
            _sync(device)
            t3 = time.perf_counter()
            if timings is not None:
                timings["data_wait"] += t1 - t0
                timings["forward"] += t2 - t1
                timings["backward"] += t3 - t2
        t4 = time.perf_counter()
        recipe.apply_gradients(self.model, self.optimizer, tr)
        _sync(device)
        self.taken += 1
        if timings is not None:
            timings["optimizer"] += time.perf_counter() - t4
        return loss_sum


def profile(cfg: JobConfig, *, steps: int = 5, use_dataset: bool = False, save: bool = True) -> dict[str, Any]:
    """Measure `steps` training steps and compare every figure with the plan's estimate."""
    w = est.Workload.from_config(cfg)
    tr = cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device.type == "cpu"
    torch.set_flush_denormal(tr.flush_denormal)  # the arithmetic `train` runs, or CPU calibration reads low
    stepper = TrainStep(cfg, device, _Batches(cfg, device, use_dataset))
    accumulation = stepper.accumulation
    peak_memory, memory_method, counter = _warm_up_and_count(stepper, cpu)
    counted_flops = counter.total * accumulation
    step_time, split, spread = _median_step(stepper, steps)

    device_name, accelerator, peak, default_efficiency, overhead = _accelerator(cfg, device)
    prior = load_calibrations(cfg.plan.calibration_dir).get(accelerator)
    efficiency_used = prior.efficiency if prior else default_efficiency

    # The plan's estimates for this exact run.
    memory = est.memory_per_device(w, strategy="ddp", count=1, accumulation=accumulation, cpu=cpu)
    estimated_peak = memory.total  # tensors only: memory_per_device got no framework overhead
    executed = w.executed_flops(tr.global_batch)
    model_flops = w.model_flops(tr.global_batch)
    estimated_step = executed / (peak * efficiency_used) + (prior.overhead_s if prior else 0.0)
    busy = max(step_time - split["data_wait"] - split["communication"], 1e-12)
    achieved = counted_flops / step_time
    efficiency = counted_flops / (busy * peak)
    tokens = tr.global_batch * w.seq_len

    comparison = [
        _row("peak memory (tensors)", peak_memory, estimated_peak, _mib),
        _row("step time", step_time, estimated_step, _ms),
        _row("executed FLOPs per step", counted_flops, executed, _gflop),
        _row("tokens per second", tokens / step_time, tokens / estimated_step, lambda x: f"{x:,.0f}"),
        _row("achieved FLOP/s", achieved, executed / estimated_step, lambda x: f"{x / 1e9:,.2f} GFLOP/s"),
    ]
    measured = {
        "peak_memory_bytes": int(peak_memory),
        "step_time_s": step_time,
        "step_time_spread": spread,
        "time_split_s": split,
        "executed_flops_per_step": counted_flops,
        "achieved_flops_per_s": achieved,
        "mfu": model_flops / (step_time * peak),
        "efficiency": efficiency,
        "tokens_per_s": tokens / step_time,
        "flops_by_op": dict(counter.by_op),
    }
    report: dict[str, Any] = {
        "device": device_name,
        "accelerator": accelerator,
        "peak_flops": peak,
        "peak_flops_source": "measured matmul" if cpu else "catalog (dense)",
        "steps": steps,
        "tokens_per_step": tokens,
        "accumulation": accumulation,
        "memory_method": memory_method,
        "measured": measured,
        "estimate": {
            "memory_bytes": memory.to_dict(),
            "memory_peak_moment": memory.phase,
            "framework_overhead_bytes": overhead,
            "step_time_s": estimated_step,
            "efficiency": efficiency_used,
            "calibrated": prior is not None,
            # where the efficiency came from: the calibration file, or the catalog's default
            "calibration_source": prior.describe() if prior else f"the catalog's default for {accelerator}",
            "executed_flops_per_step": executed,
            "model_flops_per_step": model_flops,
        },
        "comparison": comparison,
        "verdict": _verdict(split, step_time, efficiency),
        "calibration_path": None,
    }
    if cfg.parallel.tensor > 1 and (why := tensor_profile.unavailable(cfg)):  # the rest is measured all the same
        report["tensor_collectives"] = {"skipped": why}
    elif cfg.parallel.tensor > 1:
        report["tensor_collectives"] = _tensor_collectives(cfg, w, accelerator, prior)
        measured["tensor_bus_bandwidth"] = report["tensor_collectives"]["bus_bandwidth"]
        comparison.append(report["tensor_collectives"].pop("comparison"))
    if "tensor_bus_bandwidth" not in measured and prior is not None:  # kept from an earlier profile
        measured["tensor_bus_bandwidth"] = prior.tensor_bus_bandwidth
    calibration = _calibration(cfg, accelerator, measured, peak, steps)
    report["calibration"] = calibration.to_dict()
    limit = cfg.plan.calibration_max_spread
    report["calibration_refused"] = (
        f"not saved: the timed steps spread {spread:.0%} (interquartile range over the median), more than "
        f"plan.calibration_max_spread {limit:.0%}; the machine was busy: profile again when it is quiet"
        if spread is not None and spread > limit
        else ""
    )
    if save and not report["calibration_refused"]:
        report["calibration_path"] = str(save_calibration(calibration, cfg.plan.calibration_dir))
    return report


def _warm_up_and_count(stepper: TrainStep, cpu: bool) -> tuple[int, str, FlopCounter]:
    """One warm-up step (optimizer states, kernels), the peak memory of a real step, and the FLOPs of
    one micro-batch's forward + backward, counted kernel by kernel."""
    stepper.run()
    peak_memory, memory_method = _peak_memory(stepper, cpu)
    with FlopCounter() as counter, recipe.autocast(stepper.cfg.train, stepper.device):
        stepper.spec.loss_fn(stepper.model, stepper.batches.next()).backward()
    stepper.optimizer.zero_grad(set_to_none=True)
    return peak_memory, memory_method, counter


def _calibration(cfg: JobConfig, accelerator: str, measured: dict[str, Any], peak: float, steps: int) -> Calibration:
    """What this profile teaches `plan` about the accelerator (saved under plan.calibration_dir)."""
    return Calibration(
        accelerator=accelerator,
        efficiency=min(1.0, measured["efficiency"]),
        mfu=measured["mfu"],
        peak_flops=peak,
        overhead_s=measured["time_split_s"]["data_wait"],
        steps=steps,
        spread=measured["step_time_spread"] or 0.0,
        tensor_bus_bandwidth=measured.get("tensor_bus_bandwidth", 0.0),
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        config={"model": cfg.to_dict()["model"], "train": cfg.to_dict()["train"]},
    )


def _tensor_collectives(cfg: JobConfig, w: est.Workload, accelerator: str, prior: Calibration | None) -> dict[str, Any]:
    """The tensor-parallel collectives of one micro-batch, per layer (plan.tensor_profile), and the
    plan's estimate of their time: at the bandwidth an earlier profile measured, else at the catalog's
    link within a node (none for the CPU without one)."""
    from petatrain.plan.recommend import intra_bandwidth
    from petatrain.train.strategies.tensor import tensor_exposed_s

    measured = tensor_profile.measure(cfg)
    acc = load_catalog(cfg.plan).get(accelerator)
    bandwidth = intra_bandwidth(acc, prior) if acc is not None else (prior.tensor_bus_bandwidth if prior else 0.0)
    estimate = tensor_exposed_s(w, cfg.parallel.tensor, w.n_layer, 1, bandwidth) if bandwidth else None
    measured["estimate_bandwidth"] = bandwidth
    measured["comparison"] = _row(
        "tensor-parallel collectives per micro-batch", measured["seconds_per_micro_batch"], estimate, _ms
    )
    return measured


def _peak_memory(stepper: TrainStep, cpu: bool) -> tuple[int, str]:
    """Peak tensor bytes over one real step, and how they were measured."""
    if cpu:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(stepper.model, stepper.optimizer)
        with tracker:
            # MemTracker keeps per-module stats for one call; its device peak spans the whole step.
            stepper.run(before_micro_batch=tracker.reset_mod_stats)
        snapshot = tracker.get_tracker_snapshot("peak")
        peak = max(dev["Total"] for dev in snapshot.values())
        return peak, "torch.distributed._tools.mem_tracker.MemTracker (live tensor storages, one real step)"
    torch.cuda.reset_peak_memory_stats(stepper.device)
    stepper.run()
    return torch.cuda.max_memory_allocated(stepper.device), "torch.cuda.max_memory_allocated"


SPREAD_STEPS = 4  # the fewest timed steps whose interquartile range says something


def _median_step(stepper: TrainStep, steps: int) -> tuple[float, dict[str, float], float | None]:
    """The median of `steps` timed steps (by wall time, so that one step slowed by another
    process on a shared machine does not skew the calibration), its split by phase, and the
    spread of the steps: their interquartile range over the median."""
    records = []
    for _ in range(steps):
        timings = {"data_wait": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        t0 = time.perf_counter()
        stepper.run(timings)
        records.append((time.perf_counter() - t0, timings))
    records.sort(key=lambda r: r[0])
    step_time, split = records[len(records) // 2]
    split["communication"] = 0.0  # one process: no collectives to wait for
    times = [r[0] for r in records]
    if len(times) < SPREAD_STEPS or step_time <= 0:
        return step_time, split, None  # too few steps to say how they spread
    q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
    return step_time, split, (q3 - q1) / step_time


def _accelerator(cfg: JobConfig, device: torch.device) -> tuple[str, str, float, float, float]:
    """(device name, catalog name, peak FLOP/s, default efficiency, framework overhead bytes)."""
    tr = cfg.train
    if device.type == "cpu":
        peak = measure_cpu_matmul_peak(torch.bfloat16 if tr.precision == "bf16-mixed" else torch.float32)
        return f"CPU ({torch.get_num_threads()} threads)", "cpu", peak, CPU_DEFAULT_EFFICIENCY, 0.0
    device_name = torch.cuda.get_device_name(device)
    accelerator = catalog_name(device_name) or device_name
    acc = load_catalog(cfg.plan).get(accelerator)
    if acc is None:
        raise ConfigError(f"profile: {device_name!r} is not in the accelerator catalog; cannot compare with plan")
    return device_name, accelerator, acc.peak_flops(tr.precision), acc.efficiency, acc.overhead_gib * 2**30


def _verdict(split: dict[str, float], step_time: float, efficiency: float) -> str:
    fractions = {k: v / step_time for k, v in split.items()}
    if fractions["data_wait"] >= 0.2:
        return "data-bound"
    if fractions["communication"] >= 0.3:
        return "communication-bound"
    if fractions["optimizer"] >= 0.3 or efficiency < 0.25:
        return "memory-bound"
    return "compute-bound"


def _row(figure: str, measured: float, estimate: float | None, fmt) -> dict[str, Any]:
    error = None if estimate is None or measured == 0 else (estimate - measured) / measured
    return {
        "figure": figure,
        "measured": measured,
        "estimate": estimate,
        "error": error,
        "measured_text": fmt(measured),
        "estimate_text": "" if estimate is None else fmt(estimate),
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f} MiB"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def _gflop(x: float) -> str:
    return f"{x / 1e9:,.2f} GFLOP"
