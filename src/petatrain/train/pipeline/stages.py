"""A rank's share of a pipeline job: its model parts, their `PipelineStage`s and the schedule.

Every rank builds the whole model from the same seed (the weights any strategy starts from) and
keeps only what its parts use (`keep_parts`): parameter names stay the whole model's
(`blocks.3.attn.qkv.weight` on whichever rank holds block 3), so a checkpoint saved per named
parameter loads at any stages x replicas shape. Each part runs as a `Chunk` (a view over the kept
modules) inside torch.distributed.pipelining's `PipelineStage`; the schedule is torch's.

The ranks form a `DeviceMesh` of (dp, pp). With `data: ddp`, after the schedule's backward
`PipelineRank.reduce_gradients` averages the gradients over the rank's data-parallel peers (one
all-reduce of a flat buffer after the pipeline flush, as Megatron's DDP does: DDP's reducer cannot
follow GPipe's all-forwards-then-all-backwards). With `data: fsdp` each part is `fully_shard`ed over
its stage's dp ranks (per block, then the part), as torchtitan does; torch's schedule then
reduce-scatters the gradients after the last micro-batch's backward. Either way the gradients of a
weight tied across the first and the last part (the GPT's embedding and head) are summed, so both
copies take the same update, and `clip` computes the global norm over the whole pipeline.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from petatrain.errors import ConfigError
from petatrain.models import PipelineParts, tied_names
from petatrain.train.pipeline.layout import Layout
from petatrain.train.pipeline.memory import SavedActivations


class Chunk(nn.Module):
    """One model part: the root's `embed` if it holds the first unit, its blocks, `finish` if the last."""

    def __init__(self, root: nn.Module, parts: PipelineParts, blocks: list[nn.Module], *, first: bool, last: bool):
        super().__init__()
        object.__setattr__(self, "_root", root)  # not a child: its modules are registered below, once
        self.blocks = nn.ModuleList(blocks)
        names = (parts.first if first else ()) + (parts.last if last else ())
        self.ends = nn.ModuleDict({name: getattr(root, name) for name in names})
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root: Any = self._root
        if self.first:
            x = root.embed(x)
        run = getattr(root, "run_block", None)
        for block in self.blocks:
            x = run(block, x) if run is not None else block(x)
        if self.last:
            x = root.finish(x)
        return x


@dataclass(frozen=True, slots=True)
class PartPlan:
    """Which units each model part runs: part k runs units [starts[k], starts[k+1])."""

    starts: tuple[int, ...]
    n_blocks: int

    def units(self, part: int) -> range:
        end = self.starts[part + 1] if part + 1 < len(self.starts) else self.n_blocks + 2
        return range(self.starts[part], end)

    def part_of_unit(self, unit: int) -> int:
        return max(k for k, s in enumerate(self.starts) if s <= unit)


def unit_of(name: str, parts: PipelineParts, n_blocks: int) -> int:
    """The unit a parameter or buffer name belongs to: 0 (first), 1 + block index, n_blocks + 1 (last)."""
    head, _, rest = name.partition(".")
    if head == parts.blocks:
        return 1 + int(rest.partition(".")[0])
    if head in parts.first:
        return 0
    if head in parts.last:
        return n_blocks + 1
    raise ConfigError(
        f"parameter {name!r} is in none of the pipeline's parts ({parts.blocks}, {', '.join(parts.first + parts.last)})"
    )


def keep_parts(model: nn.Module, parts: PipelineParts, plan: PartPlan, mine: list[int]) -> list[Chunk]:
    """Drop from `model` (in place) every module none of the parts `mine` runs; a Chunk per part."""
    blocks = getattr(model, parts.blocks)
    kept_units = {u for part in mine for u in plan.units(part)}
    setattr(model, parts.blocks, nn.ModuleDict({str(i): b for i, b in enumerate(blocks) if 1 + i in kept_units}))
    for name in parts.first if 0 not in kept_units else ():
        setattr(model, name, None)
    for name in parts.last if plan.n_blocks + 1 not in kept_units else ():
        setattr(model, name, None)
    chunks = []
    for part in mine:
        units = plan.units(part)
        own = [blocks[u - 1] for u in units if 1 <= u <= plan.n_blocks]
        chunks.append(Chunk(model, parts, own, first=0 in units, last=plan.n_blocks + 1 in units))
    return chunks


class StageClock:
    """The time a rank's stages spend computing (their forward and backward chunks, as torch's
    schedules call them, and the last stage's loss, which the schedule computes between them),
    apart from the waits for their neighbours in between."""

    CHUNKS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: list[Any], schedule: Any = None):
        self.busy_s = 0.0
        for owner, methods in [*((stage, self.CHUNKS) for stage in stages), (schedule, ("_compute_loss",))]:
            for method in methods if owner is not None else ():
                if hasattr(owner, method):
                    setattr(owner, method, self._timed(getattr(owner, method)))

    def _timed(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0

        return run


@dataclass
class PipelineRank:
    """This rank's parts of the pipeline, its schedule and its process groups."""

    layout: Layout
    rank: int
    model: nn.Module  # the whole model's modules this rank keeps (what the optimizer steps and checkpoints save)
    chunks: list[Chunk]
    schedule: Any
    pp_group: Any
    dp_group: Any
    tie_groups: list[tuple[list[str], Any]] = field(
        default_factory=list
    )  # (this rank's copies of a tied weight, group)
    not_counted: frozenset[str] = frozenset()  # second copies of tied weights: left out of the gradient norm
    microbatches: int = 1
    clock: StageClock | None = None
    plan: PartPlan | None = None
    sharded: bool = False  # data fsdp: parameters and gradients are DTensors sharded over dp_group
    loss_parallel: bool = False  # tensor parallelism: the last part's loss over vocabulary-sharded logits
    track_memory: bool = True  # count the activations autograd saves in the next training step that is settled
    # settled: the stages are set up for training. Not in the attempt's first step, nor the first after an
    # evaluation: torch infers the stages' shapes again in it, with a forward and backward of its own.
    settled: bool = False
    activation_peak: int = 0  # the most bytes of them held at once, over the steps counted since take_window
    wall_s: float = 0.0  # time in schedule steps (training), since the clock was last read
    steps: int = 0

    @property
    def parts(self) -> list[int]:
        return self.layout.parts_of(self.layout.pp_rank(self.rank))

    def take_window(self) -> tuple[int, float, float, int]:
        """(steps, busy seconds, wall seconds, peak saved activation bytes) since the last call."""
        busy = self.clock.busy_s if self.clock else 0.0
        out = (self.steps, busy, self.wall_s, self.activation_peak)
        if self.clock:
            self.clock.busy_s = 0.0
        self.steps, self.wall_s = 0, 0.0
        self.activation_peak, self.track_memory = 0, True
        return out

    @property
    def first(self) -> bool:
        return any(c.first for c in self.chunks)

    @property
    def last(self) -> bool:
        return any(c.last for c in self.chunks)

    def forward_backward(self, tokens: torch.Tensor, *, train: bool = True) -> torch.Tensor:
        """One step of the schedule over this replica's batch `tokens` (B, T + 1); the mean loss of its
        micro-batches on a rank that runs the last part, else 0 (gradients accumulated, not reduced)."""
        args = (tokens[:, :-1],) if self.first else ()
        target = tokens[:, 1:] if self.last else None
        losses: list[torch.Tensor] = []
        busy, t0 = (self.clock.busy_s if self.clock else 0.0), time.perf_counter()
        with self._loss_context():
            self._run(args, target, losses, train)
        if train:
            self.wall_s += time.perf_counter() - t0
            self.steps += 1
        elif self.clock:
            self.clock.busy_s = busy  # evaluation is not the training step's compute
        self.settled = train
        if not losses:
            return torch.zeros((), device=tokens.device)
        return torch.stack([_local(loss.detach()).float() for loss in losses]).mean()

    def _loss_context(self) -> Any:
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _run(self, args: tuple, target: torch.Tensor | None, losses: list[torch.Tensor], train: bool) -> None:
        """One schedule step (training) or evaluation."""
        if train:
            counting = SavedActivations(list(self.model.parameters())) if self.track_memory and self.settled else None
            with counting or contextlib.nullcontext():
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            if counting is not None:  # one step a window: the count costs a Python call per saved tensor
                self.activation_peak, self.track_memory = max(self.activation_peak, counting.peak), False
        elif self.layout.style == "v":
            # torch's eval() of ZBV still runs its split backward actions and fails on a stage without
            # backward: a full step under grad instead, its gradients dropped (an evaluation's cost x3).
            with torch.enable_grad():
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            self.model.zero_grad(set_to_none=True)
        else:
            self.schedule.eval(*args, target=target, losses=losses)

    def reduce_gradients(self) -> None:
        """Average over the data-parallel peers, then sum the copies of tied weights."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        grad: dict[str, torch.Tensor] = {}
        for name, p in named.items():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
            placements = getattr(p, "placements", None)
            if p.grad is not None and placements is not None and p.grad.placements != placements:  # type: ignore[attr-defined]
                # tensor parallelism: an embedding's gradient comes back whole; its rows as the weight's
                p.grad = p.grad.redistribute(p.device_mesh, placements)  # type: ignore[attr-defined]
            if p.grad is not None:
                grad[name] = p.grad
        if self.layout.replicas > 1 and not self.sharded:  # FSDP reduce-scattered them in the schedule
            grads = list({id(g): _local(g) for g in grad.values()}.values())
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.layout.replicas
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)
        for copies, group in self.tie_groups:
            local = [_local(grad[n]) for n in copies]  # FSDP: the copies' shards are alike (same rows)
            total = torch.stack(local).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in local:
                g.copy_(total)

    def clip(self, max_norm: float) -> float:
        """The whole pipeline's gradient norm (each tied weight once), clipping to `max_norm` if set."""
        device = next(self.model.parameters()).device  # NCCL reduces device tensors, gloo host ones
        tp_rank = self.layout.tp_rank(self.rank)
        counted = [
            _local(p.grad).detach()
            for name, p in self.model.named_parameters()
            if p.grad is not None and name not in self.not_counted and (tp_rank == 0 or _tensor_split(p.grad))
        ]
        # Each tensor's norm as torch's clip_grad_norm_ takes it (foreach, in its dtype), their squares
        # summed in float64: not a float64 copy of every gradient (a step's clip cost 2.6x plain's).
        squares = torch.zeros((), dtype=torch.float64, device=device)
        if counted:
            squares = torch.stack(list(torch._foreach_norm(counted))).double().pow(2).sum()
        if self.layout.tensor == 1:
            # Each rank's squares: its stage's whole gradients (ddp), or its shard of them (fsdp: every rank's differ).
            dist.all_reduce(squares, group=None if self.sharded else self.pp_group)
        else:  # every rank's part of its replica's gradients (a parameter its group keeps whole counted once)
            dist.all_reduce(squares)
            if not self.sharded:
                squares /= self.layout.replicas
        norm = math.sqrt(float(squares.item()))
        if max_norm and math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            torch._foreach_mul_([_local(p.grad) for p in self.model.parameters() if p.grad is not None], scale)
        return norm


def gather_full(state: dict[str, Any], *, keep: bool) -> dict[str, Any]:
    """A (nested) state dict with every DTensor (data fsdp: a shard over the stage's replicas) gathered
    whole, one tensor at a time (a collective over the stage's replicas, called in the same key order);
    CPU copies where `keep`, else the structure without tensors (nothing held)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = gather_full(value, keep=keep)
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            if keep:
                out[key] = value.detach().to("cpu").clone()
        else:
            out[key] = value
    return out


def _tensor_split(tensor: torch.Tensor) -> bool:
    """Whether a DTensor is split along the mesh's tensor-parallel dimension ("tp"): each rank of the
    group holds a different part. A replicated one (a norm's weight) is the same on each."""
    from torch.distributed.tensor import Replicate

    mesh = getattr(tensor, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" not in names:
        return False
    placements = tensor.placements  # type: ignore[attr-defined]  # a DTensor (mesh above)
    return not isinstance(placements[names.index("tp")], Replicate)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (data fsdp), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def build(
    model: nn.Module,
    parts: PipelineParts,
    plan: PartPlan,
    layout: Layout,
    *,
    schedule: str,
    microbatches: int,
    device: torch.device,
    data: str = "ddp",
    precision: Any = None,
    tensor_plan: Any = None,
) -> PipelineRank:
    """This rank's PipelineRank; a collective: every rank of the job calls it, in the same order.
    `data` is what a stage's replicas run (ddp | fsdp); `precision` FSDP's MixedPrecisionPolicy;
    `tensor_plan` (a models.tensor_parallel.TensorPlan) splits each stage over `layout.tensor` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = layout.pp_rank(rank), layout.dp_rank(rank), layout.tp_rank(rank)
    # rank = (dp x stages + pp) x tensor + tp (Layout's order): the mesh's rows are replicas, its columns stages
    shape: tuple[int, ...] = (layout.replicas, layout.stages)
    names: tuple[str, ...] = ("dp", "pp")
    if layout.tensor > 1:
        shape, names = (*shape, layout.tensor), (*names, "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    mine = layout.parts_of(pp_rank)
    tie_groups, not_counted = _tie_groups(model, parts, plan, layout, dp_rank, tp_rank, mine)
    chunks = keep_parts(model, parts, plan, mine)
    model.to(device)
    if layout.tensor > 1:
        _split_tensors(model, tensor_plan, mesh["tp"], layout.tensor)
    if data == "fsdp":
        _shard(chunks, mesh["dp"], precision)
    stages = [
        PipelineStage(c, part, layout.parts, device, group=pp_group) for part, c in zip(mine, chunks, strict=True)
    ]
    loss_fn = parts.output_loss
    classes = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved": ScheduleInterleaved1F1B,
        "zbv": ScheduleZBVZeroBubble,
    }
    cls: Any = classes[schedule]
    if layout.chunks == 1:
        runner = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        runner = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    return PipelineRank(
        layout=layout, rank=rank, model=model, chunks=chunks, schedule=runner, pp_group=pp_group,
        dp_group=dp_group, tie_groups=tie_groups, not_counted=not_counted, microbatches=microbatches,
        clock=StageClock(stages, runner), plan=plan, sharded=data == "fsdp",
        loss_parallel=layout.tensor > 1 and bool(tensor_plan.loss_parallel),
    )  # fmt: skip


def _split_tensors(model: nn.Module, tensor_plan: Any, mesh: Any, degree: int) -> None:
    """The kept modules split over the tensor-parallel ranks by the model's plan (its entries for the
    modules this rank does not keep left out), the fused parameters marked on the model."""
    import fnmatch

    from torch.distributed.tensor.parallel import parallelize_module

    from petatrain.models.tensor_parallel import mark_split

    if tensor_plan is None:
        raise ConfigError("parallel.tensor: this model declares no tensor-parallel plan (return a TensorPlan)")
    present = [name for name, _ in model.named_modules()]
    styles = {k: v for k, v in tensor_plan.styles(degree).items() if any(fnmatch.fnmatchcase(n, k) for n in present)}
    mark_split(model, tensor_plan.fused(model, degree), degree)
    parallelize_module(model, mesh, styles)


def _shard(chunks: list[Chunk], mesh: Any, precision: Any) -> None:
    """FSDP2 over the stage's data-parallel ranks: each block, then each part (its ends). Parameters
    stay gathered from a micro-batch's forward to its backward (torchtitan's choice under a pipeline:
    resharding would all-gather again for every micro-batch); the schedule reshards after the last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = precision or MixedPrecisionPolicy()
    for chunk in chunks:
        for block in chunk.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(chunk, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def _tie_groups(
    model: nn.Module, parts: PipelineParts, plan: PartPlan, layout: Layout, dp_rank: int, tp_rank: int, mine: list[int]
) -> tuple[list[tuple[list[str], Any]], frozenset[str]]:
    """For each tied weight: the names of this rank's copies and the group of the ranks holding one
    (made by every rank, for every replica). A weight two of this rank's parts use gets a copy per
    part: ZBV computes a part's weight gradients on their own, and one tensor shared by two parts
    gets them wrong. The copies after the first are left out of the gradient norm."""
    entries: list[tuple[list[str], Any]] = []
    not_counted: set[str] = set()
    for names in tied_names(model):
        holders = {n: plan.part_of_unit(unit_of(n, parts, plan.n_blocks)) for n in names}
        mine_group = None
        for d in range(layout.replicas):
            for t in range(layout.tensor):  # under tensor parallelism, the copies' same rows
                ranks = sorted({layout.rank_of_part(part, d, t) for part in holders.values()})
                group = dist.new_group(ranks, group_desc="tied") if len(ranks) > 1 else None
                mine_group = group if (d, t) == (dp_rank, tp_rank) else mine_group
        local = [n for n in names if holders[n] in mine]
        by_part: dict[int, str] = {}
        for n in local:
            by_part.setdefault(holders[n], n)
        for n in list(by_part.values())[1:]:  # one tensor per part
            module_name, _, attr = n.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, attr, nn.Parameter(getattr(module, attr).detach().clone()))
        copies = list(by_part.values())
        if copies and (mine_group is not None or len(copies) > 1):
            entries.append((copies, mine_group))
        not_counted.update(c for c in copies if c != names[0])
    return entries, frozenset(not_counted)
