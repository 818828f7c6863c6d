"""`petatrain plan`: every (accelerator, count, strategy) estimated, the recommendation, why the rest lost.

For each candidate: memory per device (estimate.memory_per_device), FLOPs per step in
both conventions, step time (compute at a calibrated efficiency, exposed communication,
pipeline bubble, data loading), checkpoint cost and the Young/Daly interval, expected
goodput, and the time and cost of the whole token budget on demand and on spot.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, TypedDict

from petatrain.config import JobConfig, parse_size
from petatrain.cost.calibration import Calibration, load_calibrations
from petatrain.errors import ConfigError
from petatrain.plan import estimate as est
from petatrain.plan.catalog import GIB, Accelerator, find, load_catalog
from petatrain.train import recipe, strategies
from petatrain.train.strategies import OVERLAP

STRATEGIES = tuple(strategies.REGISTRY)
# Achieved collective bus bandwidth over the link's peak (nccl-tests reach ~80% on NVLink and IB).
LINK_EFFICIENCY = 0.8


@dataclass(kw_only=True, slots=True)
class Candidate:
    accelerator: str
    count: int
    strategy: str
    fits: bool
    memory: est.MemoryEstimate
    memory_capacity_bytes: int
    model_flops_per_step: float
    executed_flops_per_step: float
    compute_s: float
    communication_s: float
    bubble_s: float
    data_s: float
    step_time_s: float
    mfu: float
    efficiency: float
    calibrated: bool
    tokens_per_s: float
    checkpoint_bytes: float
    checkpoint_stall_s: float
    checkpoint_write_s: float
    checkpoint_interval_s: float
    goodput: float
    goodput_spot: float
    run_time_s: float
    run_time_spot_s: float
    cost_usd: float
    cost_usd_spot: float
    reason: str = ""
    feasible: bool = True  # the candidate can run at all (batch divides, enough layers)
    layout: dict[str, Any] = field(default_factory=dict)  # a pipeline's stages, replicas, micro-batches, recompute

    @property
    def rejected(self) -> bool:
        return bool(self.reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "accelerator": self.accelerator,
            "count": self.count,
            "strategy": self.strategy,
            "fits": self.fits,
            "memory_bytes": self.memory.to_dict(),
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "memory_headroom_bytes": int(self.memory_capacity_bytes - self.memory.total),
            "memory_peak_moment": self.memory.phase,
            "model_flops_per_step": self.model_flops_per_step,
            "executed_flops_per_step": self.executed_flops_per_step,
            "step_time_s": self.step_time_s,
            "step_time_breakdown_s": {
                "compute": self.compute_s,
                "communication_exposed": self.communication_s,
                "pipeline_bubble": self.bubble_s,
                "data_loading": self.data_s,
            },
            "mfu": self.mfu,
            "efficiency": self.efficiency,
            "calibrated": self.calibrated,
            "tokens_per_s": self.tokens_per_s,
            "checkpoint": {
                "bytes": self.checkpoint_bytes,
                "stall_s": self.checkpoint_stall_s,
                "write_s": self.checkpoint_write_s,
                "interval_s": self.checkpoint_interval_s,
            },
            "goodput": self.goodput,
            "goodput_spot": self.goodput_spot,
            "run_time_s": self.run_time_s,
            "run_time_spot_s": self.run_time_spot_s,
            "cost_usd": self.cost_usd,
            "cost_usd_spot": self.cost_usd_spot,
            "reason": self.reason,
            "layout": self.layout,
        }


@dataclass(kw_only=True, slots=True)
class PlanRequest:
    accelerator: str = ""  # one catalog name, or "" for all
    count: int = 0  # one count, or 0 for powers of two up to max_count
    max_count: int = 1024
    budget_usd: float = 0.0  # 0 = no budget
    deadline_hours: float = 0.0  # 0 = no deadline
    mtbf_hours: float = 0.0  # per node; 0 = faults.mtbf_hours
    strategies: tuple[str, ...] = ()  # () = all; the job's parallel.strategy is always included


@dataclass(kw_only=True, slots=True)
class Plan:
    workload: est.Workload
    candidates: list[Candidate]
    recommended: Candidate | None
    objective: str
    assumptions: dict[str, Any] = field(default_factory=dict)
    pipeline_vs_fsdp: dict[str, str] = field(default_factory=dict)  # "ACCELERATOR xN" -> why one wins
    layouts: dict[str, list[str]] = field(default_factory=dict)  # "ACCELERATOR xN" -> each strategy's best, why

    def to_dict(self) -> dict[str, Any]:
        w = self.workload
        return {
            "model": {
                "params": w.params,
                "params_non_embedding": w.params_non_embedding,
                "tokens": w.tokens,
                "model_flops_per_token": w.model_flops(1) / w.seq_len,
                "kv_cache_bytes_per_sequence": est.kv_cache_bytes(
                    batch=1, seq_len=w.seq_len, n_layer=w.n_layer, d_model=w.d_model
                )
                if w.kind == "gpt"
                else 0,
            },
            "objective": self.objective,
            "assumptions": self.assumptions,
            "candidates": [c.to_dict() for c in self.candidates],
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "pipeline_vs_fsdp": self.pipeline_vs_fsdp,
            "layouts": self.layouts,
        }


def counts_for(request: PlanRequest) -> list[int]:
    if request.count:
        return [request.count]
    out, n = [], 1
    while n <= request.max_count:
        out.append(n)
        n *= 2
    return out


def evaluate(
    w: est.Workload,
    acc: Accelerator,
    count: int,
    strategy: str,
    cfg: JobConfig,
    calibration: Calibration | None,
    mtbf_hours: float,
) -> Candidate:
    """Estimate one candidate (no recommendation logic); a pipeline's best P x D layout."""
    if strategy == "pipeline":
        return _best_pipeline(w, acc, count, cfg, calibration, mtbf_hours)
    if strategy == "tensor":
        return _best_tensor(w, acc, count, cfg, calibration, mtbf_hours)
    return _evaluate(w, acc, count, strategies.get(strategy), cfg, calibration, mtbf_hours)


def evaluate_layout(
    cfg: JobConfig,
    accelerator: str,
    count: int,
    *,
    tensor: int = 1,
    stages: int = 1,
    data: str = "fsdp",
    micro_batch: int = 1,
    recompute: str = "none",
) -> Candidate:
    """One given layout estimated (a published one, to hold plan's own choice against): `tensor` x
    `stages` x count / (tensor x stages) replicas under `data`, `micro_batch` rows a micro-batch."""
    from petatrain.train.strategies.pipeline import Pipeline
    from petatrain.train.strategies.tensor import Tensor

    acc = find(accelerator, load_catalog(cfg.plan))
    w = dataclasses.replace(est.Workload.from_config(cfg).with_micro_batch(micro_batch), recompute=recompute)
    calibration = load_calibrations(cfg.plan.calibration_dir).get(acc.name)
    if stages > 1:
        spec: strategies.Strategy = Pipeline(stages, data, tensor)
    elif tensor > 1:
        spec = Tensor(tensor, data)
    else:
        spec = strategies.get(data)
    c = _evaluate(w, acc, count, spec, cfg, calibration, cfg.faults.mtbf_hours)
    replicas = count // (tensor * stages)
    label = f"tensor {tensor} x " if tensor > 1 else ""
    label += f"pipeline {stages} x " if stages > 1 else ""
    c.layout = {"label": f"{label}{data} {replicas}, b={micro_batch}, recompute {recompute}"}
    return c


def tensor_degrees(w: est.Workload, acc: Accelerator, count: int) -> list[int]:
    """Tensor-parallel degrees a group of one node's devices can take: 2, 4, 8 (NVLink / NVSwitch
    reach within a node only), dividing `count` and the sizes the GPT's plan splits."""
    from petatrain.train.strategies.tensor import tensor_split_problem

    return [t for t in (2, 4, 8) if t <= acc.node_devices and count % t == 0 and not tensor_split_problem(w, t)]


def _best_tensor(
    w: est.Workload, acc: Accelerator, count: int, cfg: JobConfig, calibration: Calibration | None, mtbf_hours: float
) -> Candidate:
    """The fastest tensor-parallel layout on `count` devices that fits: T ranks of a node split each
    layer (T in 2, 4, 8) x count / T replicas under DDP or FSDP, the micro-batch (a group's
    activations are split T ways, so it may be larger than the config's) and the recompute policy."""
    from petatrain.train.strategies.tensor import Tensor, tensor_exposed_s

    tried: list[Candidate] = []
    policies = ("none", "selective", "full") if w.kind == "gpt" else ("none",)
    for t in tensor_degrees(w, acc, count) if w.kind == "gpt" else []:
        replicas = count // t
        for micro in (1, 2, 4, 8, 16, 32):
            if w.global_batch % (replicas * micro):
                continue
            for recompute, data in itertools.product(policies, ("ddp", "fsdp") if replicas > 1 else ("ddp",)):
                shaped = dataclasses.replace(w.with_micro_batch(micro), recompute=recompute)
                c = _evaluate(shaped, acc, count, Tensor(t, data), cfg, calibration, mtbf_hours)
                accumulation = w.global_batch // (replicas * micro)
                tp_s = tensor_exposed_s(shaped, t, w.n_layer, accumulation, intra_bandwidth(acc, calibration))
                c.layout = {
                    "tensor": t, "replicas": replicas, "data": data, "micro_batch": micro, "recompute": recompute,
                    "tensor_comm_s": tp_s,
                    "label": f"tensor {t}x{replicas} {data} b={micro}" + _recompute(recompute),
                    "settings": [
                        f"parallel.strategy={data}", f"parallel.tensor={t}", f"train.micro_batch={micro}",
                        f"train.activation_checkpointing={recompute}",
                    ],
                }  # fmt: skip
                tried.append(c)
    if not tried:  # no degree fits a node, the count and the model: the plain estimate at 2, marked why
        c = _evaluate(w, acc, count, Tensor(2, "ddp"), cfg, calibration, mtbf_hours)
        c.feasible = False
        c.reason = (
            f"infeasible: no tensor-parallel degree of 2, 4 or 8 fits a {acc.node_devices}-device node, "
            f"{count} devices and the model's heads, MLP width, vocabulary and sequence"
        )
        return c
    return _fastest_that_fits(tried)


def _fastest_that_fits(tried: list[Candidate]) -> Candidate:
    """The fastest of a search's layouts that fits; when none fits, the one closest to fitting."""
    return min(tried, key=lambda c: (not c.feasible, not c.fits, c.step_time_s if c.fits else c.memory.total))


def _recompute(policy: str) -> str:
    return f" recompute {policy}" if policy != "none" else ""


def intra_bandwidth(acc: Accelerator, calibration: Calibration | None = None) -> float:
    """Bytes/s a tensor-parallel group's collectives get inside a node: what `profile` measured on
    this accelerator, else the catalog's link at LINK_EFFICIENCY."""
    if calibration is not None and calibration.tensor_bus_bandwidth > 0:
        return calibration.tensor_bus_bandwidth
    return LINK_EFFICIENCY * acc.intra_link_gb_s_per_direction * 1e9


def _best_pipeline(
    w: est.Workload, acc: Accelerator, count: int, cfg: JobConfig, calibration: Calibration | None, mtbf_hours: float
) -> Candidate:
    """The fastest pipeline layout on `count` devices that fits: P stages x D replicas (running DDP, or
    FSDP when D > 1: the same traffic, the optimizer state split D ways), M micro-batches (multiples of
    P: 1F1B needs M >= P, and more shrink the bubble but the micro-batch with them) and the recompute
    policy (recomputing trades compute for the activations of the in-flight micro-batches)."""
    from petatrain.train.strategies.pipeline import Pipeline
    from petatrain.train.strategies.tensor import tensor_exposed_s

    tried: list[Candidate] = []
    policies = ("none", "selective", "full") if w.kind == "gpt" else ("none",)
    degrees = [1, *(tensor_degrees(w, acc, count) if w.kind == "gpt" else [])]
    for t, stages in itertools.product(degrees, range(2, min(count, w.n_layer) + 1)):
        if count % (stages * t):
            continue
        replicas = count // (stages * t)
        for m in (stages, 2 * stages, 4 * stages, 8 * stages):
            if w.global_batch % (replicas * m):
                continue
            micro = w.global_batch // (replicas * m)
            for recompute, data in itertools.product(policies, ("ddp", "fsdp") if replicas > 1 else ("ddp",)):
                shaped = dataclasses.replace(w.with_micro_batch(micro), recompute=recompute)
                c = _evaluate(shaped, acc, count, Pipeline(stages, data, t), cfg, calibration, mtbf_hours)
                layers = math.ceil(w.n_layer / stages)
                c.layout = {"stages": stages, "replicas": replicas, "microbatches": m, "micro_batch": micro}
                c.layout.update(recompute=recompute, data=data, tensor=t)
                c.layout["tensor_comm_s"] = tensor_exposed_s(shaped, t, layers, m, intra_bandwidth(acc, calibration))
                tensor = f" tensor {t}" if t > 1 else ""
                c.layout["label"] = f"pipeline {stages}x{replicas}{tensor} M={m}" + _recompute(recompute)
                c.layout["settings"] = [
                    "parallel.strategy=pipeline", f"parallel.pipeline.stages={stages}",
                    f"parallel.pipeline.microbatches={m}", f"train.micro_batch={micro}",
                    f"train.activation_checkpointing={recompute}", f"parallel.pipeline.data={data}",
                    *([f"parallel.tensor={t}"] if t > 1 else []),
                ]  # fmt: skip
                tried.append(c)
    if not tried:  # no layout divides the batch: the plain estimate says why
        return _evaluate(w, acc, count, strategies.get("pipeline"), cfg, calibration, mtbf_hours)
    return _fastest_that_fits(tried)


def pipeline_vs_fsdp(pipe: Candidate, fsdp: Candidate) -> str:
    """Why the pipeline layout beats FSDP on the same devices, or loses to it, in one sentence."""
    shape = pipe.layout
    name = (
        f"pipeline {shape.get('stages')}x{shape.get('replicas')} (M={shape.get('microbatches')}, "
        f"recompute {shape.get('recompute')}{', FSDP replicas' if shape.get('data') == 'fsdp' else ''})"
    )
    cannot = ("infeasible", "out of memory")
    if pipe.reason.startswith(cannot) or fsdp.reason.startswith(cannot):
        loser, other = (pipe, fsdp) if pipe.reason.startswith(cannot) else (fsdp, pipe)
        if not other.reason.startswith(cannot):
            return f"{other.strategy if other is fsdp else name} runs, {loser.strategy}: {loser.reason}"
        return f"neither fits: {name}: {pipe.reason}; fsdp: {fsdp.reason}"
    pipe_cost = pipe.bubble_s + pipe.communication_s
    verdict = "beats" if pipe.step_time_s < fsdp.step_time_s else "loses to"
    return (
        f"{name} {verdict} fsdp ({pipe.step_time_s:.3g} s against {fsdp.step_time_s:.3g} s a step): the pipeline "
        f"pays {pipe.bubble_s:.3g} s of bubble and {pipe.communication_s:.3g} s of transfers and replica "
        f"all-reduce ({pipe_cost:.3g} s), FSDP {fsdp.communication_s:.3g} s of all-gathers and reduce-scatters "
        f"its compute does not hide"
    )


def explain_layout(c: Candidate) -> str:
    """One candidate in a line: its step and what it pays besides compute (the exposed collectives by
    kind, the bubble), and the memory term that decides whether it fits."""
    label = c.layout.get("label", c.strategy)
    if c.reason.startswith(("infeasible", "out of memory")):
        return f"{label}: {c.reason}"
    parts = [f"compute {c.compute_s:.3g} s"]
    tp = float(c.layout.get("tensor_comm_s", 0.0))
    if tp:
        parts.append(f"tensor-parallel collectives {tp:.3g} s (inside the node)")
    rest = c.communication_s - tp
    if rest > 1e-9:
        kind = {"fsdp": "gathers and reduce-scatters", "pipeline": "stage transfers and replica all-reduce"}
        parts.append(f"{kind.get(c.strategy, 'data-parallel all-reduce')} {rest:.3g} s exposed")
    if c.bubble_s:
        parts.append(f"bubble {c.bubble_s:.3g} s")
    terms = c.memory.to_dict()
    del terms["total"]
    biggest = max(terms, key=lambda k: terms[k])
    memory = f"{c.memory.total / GIB:.1f} GiB a device, most of it {biggest} ({terms[biggest] / GIB:.1f})"
    return f"{label}: {c.step_time_s:.3g} s a step = " + " + ".join(parts) + f"; {memory}"


def _evaluate(
    w: est.Workload,
    acc: Accelerator,
    count: int,
    spec: strategies.Strategy,
    cfg: JobConfig,
    calibration: Calibration | None,
    mtbf_hours: float,
) -> Candidate:
    n, strategy = count, spec.name
    feasible_reason = spec.infeasible(w, n)
    try:  # the micro-batch and accumulation `train` runs with
        micro, accumulation = recipe.micro_batching(w, spec.data_parallel(n))
        w = w.with_micro_batch(micro)
    except ConfigError as exc:
        feasible_reason, accumulation = feasible_reason or str(exc), 1
    G, s = w.global_batch, w.seq_len
    memory = est.memory_per_device(
        w, strategy=spec, count=n, accumulation=accumulation, framework_overhead=acc.overhead_gib * GIB
    )
    capacity = acc.memory_bytes
    fits = memory.total <= capacity

    peak = acc.peak_flops(w.precision)
    efficiency = calibration.efficiency if calibration else acc.efficiency
    model_flops, executed = w.model_flops(G), w.executed_flops(G)
    compute = executed / n / (peak * efficiency)

    # Communication over the slowest link the collective crosses; tensor-parallel groups within a node.
    nodes = math.ceil(n / acc.node_devices)
    intra = acc.intra_link_gb_s_per_direction * 1e9
    bandwidth = LINK_EFFICIENCY * (intra if nodes == 1 else min(intra, acc.network_bytes_per_device()))
    exposed, bubble = spec.communication_s(
        w,
        n,
        compute_s=compute,
        accumulation=accumulation,
        bandwidth=bandwidth,
        intra_bandwidth=intra_bandwidth(acc, calibration),
    )

    # Data: the loader streams in the background; a step cannot be faster than its bytes.
    token_bytes = 2 if w.vocab_size <= 2**16 else 4
    storage_bw = parse_size(cfg.plan.storage_bandwidth.removesuffix("/s"))
    data = G * (s + 1) * token_bytes / max(1, nodes) / storage_bw
    busy = compute + exposed + bubble
    step = max(busy, data)
    tokens_per_s = G * s / step
    achieved_mfu = model_flops / (step * n * peak)

    ckpt = _checkpoints(w, spec, acc, n, cfg, mtbf_hours)
    goodput, goodput_spot = ckpt["goodput"], ckpt["goodput_spot"]
    run_time = w.tokens / tokens_per_s / goodput if goodput > 0 else math.inf
    run_time_spot = w.tokens / tokens_per_s / goodput_spot if goodput_spot > 0 else math.inf
    cand = Candidate(
        accelerator=acc.name,
        count=n,
        strategy=strategy,
        fits=fits,
        memory=memory,
        memory_capacity_bytes=capacity,
        model_flops_per_step=model_flops,
        executed_flops_per_step=executed,
        compute_s=compute,
        communication_s=exposed,
        bubble_s=bubble,
        data_s=data,
        step_time_s=step,
        mfu=achieved_mfu,
        efficiency=efficiency,
        calibrated=calibration is not None,
        tokens_per_s=tokens_per_s,
        **ckpt,
        run_time_s=run_time,
        run_time_spot_s=run_time_spot,
        cost_usd=run_time / 3600 * n * acc.usd_per_hour,
        cost_usd_spot=run_time_spot / 3600 * n * acc.usd_per_hour_spot,
    )
    _explain(cand, feasible_reason, busy_s=busy, storage_bw=storage_bw, cfg=cfg)
    return cand


def _explain(cand: Candidate, infeasible: str | None, *, busy_s: float, storage_bw: float, cfg: JobConfig) -> None:
    """The candidate's reason, if something rules it out or bounds it: shape, memory, storage."""
    gib = cand.memory.total / GIB, cand.memory_capacity_bytes / GIB
    if infeasible:
        cand.feasible = False
        cand.reason = f"infeasible: {infeasible}"
    elif not cand.fits:
        cand.reason = f"out of memory: needs {gib[0]:.1f} GiB per device, {cand.accelerator} has {gib[1]:.1f} GiB"
    elif cand.data_s > busy_s:
        need = cand.data_s / busy_s * storage_bw  # bytes per second per node that would keep up
        cand.reason = (
            f"data-bound: needs {need / 1e9:.2f} GB/s per node from storage, plan.storage_bandwidth is "
            f"{cfg.plan.storage_bandwidth}"
        )


class _CheckpointCosts(TypedDict):
    checkpoint_bytes: float
    checkpoint_stall_s: float
    checkpoint_write_s: float
    checkpoint_interval_s: float
    goodput: float
    goodput_spot: float


def _checkpoints(
    w: est.Workload, spec: strategies.Strategy, acc: Accelerator, n: int, cfg: JobConfig, mtbf_hours: float
) -> _CheckpointCosts:
    """Checkpoint size, the loop's snapshot stall, the write, the Young/Daly interval (the
    recipe's, as `train` takes it) and the expected goodput on demand and on spot."""
    nodes = math.ceil(n / acc.node_devices)
    total = (w.weight_width + w.optimizer_width) * w.params  # fp32 weights + optimizer states
    stall = spec.checkpoint_bytes_per_device(total, n) / (acc.pcie_gb_s_per_direction * 1e9)
    write = total / (nodes * parse_size(cfg.plan.checkpoint_bandwidth.removesuffix("/s")))
    mtbf = mtbf_hours * 3600 / nodes
    interval = recipe.checkpoint_interval_s(stall, mtbf, write)
    spot_mtbf = 1 / (1 / mtbf + nodes / (cfg.plan.spot_mtbf_hours * 3600))
    spot_interval = recipe.checkpoint_interval_s(stall, spot_mtbf, write)
    return {
        "checkpoint_bytes": total,
        "checkpoint_stall_s": stall,
        "checkpoint_write_s": write,
        "checkpoint_interval_s": interval,
        "goodput": est.expected_goodput(interval, stall, cfg.plan.restart_s, mtbf),
        "goodput_spot": est.expected_goodput(spot_interval, stall, cfg.plan.restart_s, spot_mtbf),
    }


def plan(cfg: JobConfig, request: PlanRequest | None = None) -> Plan:
    """Estimate every candidate and pick the recommendation."""
    request = request or PlanRequest()
    w = est.Workload.from_config(cfg)
    catalog = load_catalog(cfg.plan)
    accelerators = [find(request.accelerator, catalog)] if request.accelerator else list(catalog.values())
    calibrations = load_calibrations(cfg.plan.calibration_dir)
    names = request.strategies or STRATEGIES
    if cfg.parallel.strategy not in names:
        names = (*names, cfg.parallel.strategy)
    mtbf_hours = request.mtbf_hours or cfg.faults.mtbf_hours
    candidates = [
        evaluate(w, acc, n, strategy, cfg, calibrations.get(acc.name), mtbf_hours)
        for acc in accelerators
        for n in counts_for(request)
        for strategy in names
    ]
    hours = request.deadline_hours
    budget = request.budget_usd
    for c in candidates:
        if c.reason:
            continue
        if hours and c.run_time_s > hours * 3600:
            c.reason = f"too slow: {c.run_time_s / 3600:.1f} h > deadline {hours:g} h"
        elif budget and c.cost_usd > budget:
            c.reason = f"over budget: ${c.cost_usd:,.0f} > ${budget:,.0f}"
    ok = [c for c in candidates if not c.reason]
    if hours or not budget:
        objective = (
            "cheapest"
            + (f" within the {hours:g} h deadline" if hours else "")
            + (f" and the ${budget:,.0f} budget" if budget else "")
        )
        best = min(ok, key=lambda c: (c.cost_usd, c.run_time_s, c.count), default=None)
    else:
        objective = f"fastest within the ${budget:,.0f} budget"
        best = min(ok, key=lambda c: (c.run_time_s, c.cost_usd, c.count), default=None)
    assumptions = {
        "storage_bandwidth_per_node": cfg.plan.storage_bandwidth,
        "checkpoint_bandwidth_per_node": cfg.plan.checkpoint_bandwidth,
        "mtbf_hours_per_node": mtbf_hours,
        "spot_mtbf_hours_per_node": cfg.plan.spot_mtbf_hours,
        "restart_s": cfg.plan.restart_s,
        "link_efficiency": LINK_EFFICIENCY,
        "overlap": OVERLAP,
        "calibrated_accelerators": sorted(calibrations),
        # where each calibrated accelerator's efficiency comes from (`profile` wrote it)
        "calibrations": {name: cal.describe() for name, cal in sorted(calibrations.items())},
    }
    versus = {}
    by_key = {(c.accelerator, c.count, c.strategy): c for c in candidates}
    layouts: dict[str, list[str]] = {}
    for (acc_name, n, strategy), c in by_key.items():
        if strategy == "pipeline" and (acc_name, n, "fsdp") in by_key:
            versus[f"{acc_name} x{n}"] = pipeline_vs_fsdp(c, by_key[(acc_name, n, "fsdp")])
        layouts.setdefault(f"{acc_name} x{n}", []).append(explain_layout(c))
    return Plan(
        workload=w, candidates=candidates, recommended=best, objective=objective, assumptions=assumptions,
        pipeline_vs_fsdp=versus, layouts=layouts,
    )  # fmt: skip
