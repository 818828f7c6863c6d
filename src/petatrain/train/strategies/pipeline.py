"""Pipeline parallelism (GPipe, 1F1B of Narayanan et al. 2021, interleaved, ZBV): the model cut into
stages, the global batch's micro-batches flowing through them; `parallel.pipeline.stages` x data-parallel
replicas = workers. `train` runs it through train/pipeline/ (torch.distributed.pipelining);
`plan` models pure pipelines (no replicas yet)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from petatrain.cost import formulas
from petatrain.errors import ConfigError
from petatrain.train.strategies.base import (
    ReadRankFile,
    SavedState,
    StateDicts,
    StateLayout,
    Strategy,
    autocast_copies,
    load_by_name,
    read_by_name,
)
from petatrain.train.strategies.fsdp import precision_policy
from petatrain.train.strategies.tensor import tensor_exposed_s, tensor_split_problem

if TYPE_CHECKING:
    import torch
    from torch import nn

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec

log = logging.getLogger(__name__)

# The whole model's tied parameter names, kept on a rank's (pruned) model: a checkpoint may hold a
# tied weight's optimizer state under another of its names than the one this rank keeps.
TIED_NAMES = "petatrain_tied_names"


class Pipeline(Strategy):
    """`stages` 0 (the registry's): every device a stage; `Pipeline(stages=P, data=..., tensor=T)`: P
    stages x count / (P T) data-parallel replicas of the pipeline, the replicas of a stage running DDP
    or FSDP, each stage split T ways by tensor parallelism (what `plan` searches)."""

    name = "pipeline"
    trainable = True

    def __init__(self, stages: int = 0, data: str = "ddp", tensor: int = 1):
        self.stages, self.data, self.tensor = stages, data, tensor

    def _shape(self, count: int) -> tuple[int, int]:
        """(stages, replicas) on `count` devices."""
        stages = self.stages or count // self.tensor
        return stages, max(1, count // (stages * self.tensor))

    def data_parallel(self, count: int) -> int:
        return self._shape(count)[1]  # each replica of the pipeline sees its share of the global batch

    def infeasible(self, w: Workload, count: int) -> str:
        stages, _ = self._shape(count)
        if stages < 2 or stages > w.n_layer:
            return f"pipeline needs 2..{w.n_layer} stages (model.n_layer), not {stages}"
        if count % (stages * self.tensor):
            tensor = f" x tensor-parallel degree {self.tensor}" if self.tensor > 1 else ""
            return f"{count} devices are not a multiple of {stages} stages{tensor}"
        return tensor_split_problem(w, self.tensor) if self.tensor > 1 else ""

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        """A stage's share: 1/P of the model. Under data fsdp its replicas also split the weights and
        the optimizer state D ways, but hold the stage's weights gathered (FSDP's compute dtype)
        and its gradients whole through the step (reduce-scattered after the flush)."""
        t = self.tensor
        P, (n, d) = w.params / t, self._shape(count)
        stage_layers = math.ceil(w.n_layer / n)
        shards = d if self.data == "fsdp" else 1
        gathered = w.gathered_width * P / n if shards > 1 else 0.0
        return StateLayout(
            weights=w.weight_width * P / n / shards,
            gradients=w.grad_width * P / n,
            optimizer=w.optimizer_width * P / n / shards,
            buffers=gathered if shards > 1 else autocast_copies(w, stage_layers) / t,
            stage_layers=stage_layers,
            in_flight=min(n, accumulation),  # 1F1B: the first stage holds p micro-batches
            grad_shards=t,
            optimizer_shards=n * shards * t,
            activation_shards=t,
        )

    def communication_s(
        self,
        w: Workload,
        count: int,
        *,
        compute_s: float,
        accumulation: int,
        bandwidth: float,
        intra_bandwidth: float = 0.0,
    ) -> tuple[float, float]:
        """Activations forward and gradients back across each stage boundary, per micro-batch; the
        replicas' all-reduce of a stage's gradients after the flush (not hidden: backward is over);
        and the bubble, (P - 1) / M of the compute."""
        stages, replicas = self._shape(count)
        if count <= 1:
            return 0.0, 0.0
        t = self.tensor
        # Under tensor (sequence) parallelism a rank sends its 1/t of the positions.
        act_bytes = w.micro_batch * w.seq_len * w.d_model * w.activation_bytes_per_element / t
        p2p = accumulation * 2 * act_bytes / bandwidth if stages > 1 else 0.0
        reduce = formulas.ring_allreduce_seconds(w.grad_width * w.params / stages / t, replicas, bandwidth)
        layers = math.ceil(w.n_layer / stages)
        tp = tensor_exposed_s(w, t, layers, accumulation, intra_bandwidth or bandwidth)
        return p2p + reduce + tp, compute_s * formulas.bubble_overhead(stages, accumulation)

    # --- train ------------------------------------------------------------------------------
    def check_config(self, cfg: JobConfig) -> None:
        from petatrain.train.strategies.tensor import builtin_plan

        for workers in cfg.parallel.worker_range():
            self.data_shard(cfg, 0, workers)  # the batch divides into replicas x micro-batches
        if cfg.parallel.tensor > 1:  # each stage split by tensor parallelism: the shapes must divide
            plan = builtin_plan(cfg)
            problem = plan.problem(cfg.parallel.tensor) if plan is not None else ""
            if problem:
                raise ConfigError(problem)

    def steps(self, spec: ModelSpec, cfg: JobConfig, device: torch.device, world: int) -> Any:
        import torch.distributed as dist

        from petatrain.models import tied_names
        from petatrain.train.pipeline import costs, stages
        from petatrain.train.pipeline.layout import Layout
        from petatrain.train.pipeline.memory import state_copies
        from petatrain.train.steps import PipelineSteps

        pc = cfg.parallel.pipeline
        if spec.pipeline is None:
            raise ConfigError(
                f"model.kind {cfg.model.kind}: parallel.strategy pipeline needs a model that names its parts "
                "(return (module, loss_fn, PipelineParts) from the factory)"
            )
        layout = Layout.of(pc.stages, world, pc.chunks_per_rank(), pc.schedule, cfg.parallel.tensor)
        n_blocks = len(getattr(spec.module, spec.pipeline.blocks))
        micro = cfg.train.global_batch // layout.replicas // pc.microbatch_count()
        # Rank 0's layer profile, on every rank: the calibration folder is on the driver's side of a
        # cluster, and ranks that cut the model differently would wait on each other forever.
        shared: list[Any] = [None]
        if dist.get_rank() == 0:
            found = costs.load(cfg, costs.device_name(device))
            shared[0] = found.to_dict() if found else None
        dist.broadcast_object_list(shared, src=0)
        profile = costs.LayerProfile(**shared[0]) if shared[0] else None
        limit = costs.device_memory(device)
        starts = _boundaries(
            spec,
            cfg,
            n_blocks,
            layout.parts,
            profile,
            micro,
            limit=limit,
            replicas=layout.replicas,
            tensor=layout.tensor,
        )
        plan = stages.PartPlan(tuple(starts), n_blocks)
        setattr(spec.module, TIED_NAMES, tied_names(spec.module))
        piped = stages.build(
            spec.module, spec.pipeline, plan, layout, schedule=pc.schedule, microbatches=pc.microbatch_count(),
            device=device, data=pc.data, precision=precision_policy(cfg) if pc.data == "fsdp" else None,
            tensor_plan=spec.tensor if layout.tensor > 1 else None,
        )  # fmt: skip
        if dist.get_rank() == 0:
            log.info("pipeline parts (first unit of each): %s", list(plan.starts))
        steps = PipelineSteps(piped, pc.schedule)
        if profile is not None:  # this rank's compute and memory, as the layer profile predicts them
            copies = state_copies(cfg.train.optimizer, cfg.train.precision)
            busy, state, activations = costs.predict_rank(
                profile, piped, micro, sharded=pc.data == "fsdp", copies=copies
            )
            steps.predicted_step_busy_s, steps.predicted_state_bytes = busy, state
            steps.predicted_activation_bytes = activations
        return steps

    def rng_rank(self, cfg: JobConfig, rank: int) -> int:
        """The ranks splitting a stage by tensor parallelism draw one dropout stream (strategies/tensor.py)."""
        return rank // cfg.parallel.tensor

    def data_shard(self, cfg: JobConfig, rank: int, world: int) -> tuple[int, int, int]:
        """(loader rank, loader world, rows per `next()`): a replica's ranks read the same whole batch."""
        pc = cfg.parallel.pipeline
        group = pc.stages * cfg.parallel.tensor  # a replica's ranks
        replicas = world // group
        m, g = pc.microbatch_count(), cfg.train.global_batch
        if g % (replicas * m):
            raise ConfigError(
                f"train.global_batch {g} is not divisible by parallel.pipeline.microbatches {m} x {replicas} "
                f"data-parallel replicas (e.g. global_batch {replicas * m * max(1, g // (replicas * m))})"
            )
        return rank // group, replicas, g // replicas

    def saves_model(self, rank: int, cfg: JobConfig | None = None) -> bool:
        if cfg is None:
            return False
        tensor = cfg.parallel.tensor  # the first replica's ranks, one per part (the first of its tensor group)
        return rank < cfg.parallel.pipeline.stages * tensor and rank % tensor == 0

    def state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: int,
        cfg: JobConfig,
        kept: StateDicts | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Under data fsdp, each stage's shards gathered whole on its first replica's rank (a
        collective over the stage's replicas): the checkpoint holds whole tensors by name at any `data`."""
        if cfg.parallel.pipeline.data != "fsdp" and cfg.parallel.tensor == 1:
            return super().state_dicts(model, optimizer, rank=rank, cfg=cfg, kept=kept)
        model_sd, optim_sd = super().state_dicts(model, optimizer, rank=rank, cfg=cfg)
        from petatrain.models.tensor_parallel import in_unsplit_order
        from petatrain.train.pipeline.stages import gather_full

        keep = self.saves_model(rank, cfg)
        model_sd, optim_sd = gather_full(model_sd, keep=keep), gather_full(optim_sd, keep=keep)
        optim_sd["state"] = in_unsplit_order(model, optim_sd["state"])  # a fused q|k|v in the unsplit order
        return in_unsplit_order(model, model_sd), optim_sd

    def read_for_resume(
        self, state: SavedState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every file of the checkpoint merged by name (a pipeline's at any shape, DDP's or FSDP's)."""
        return read_by_name(state, read, rank=rank, world=world, ties=getattr(model, TIED_NAMES, []))

    def load_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: SavedState,
        shards: dict[int, dict[str, torch.Tensor]],
        *,
        rank: int,
    ) -> None:
        """This rank's parameters and their optimizer state, by name (a fused q|k|v in the row order its
        tensor-parallel split holds)."""
        from petatrain.train.strategies.tensor import permute_fused

        load_by_name(model, optimizer, state, permute_fused(model, shards[0]), getattr(model, TIED_NAMES, []))


def _boundaries(
    spec: ModelSpec,
    cfg: JobConfig,
    n_blocks: int,
    parts: int,
    profile: Any,
    micro_batch: int,
    *,
    limit: float = 0.0,
    replicas: int = 1,
    tensor: int = 1,
) -> list[int]:
    """Where each part starts (in units: first, blocks, last), as parallel.pipeline.partition says:
    `profile` (PipeDream's dynamic program over the measured per-unit times; `auto` when this model
    has a layer profile here), `parameters` (the same over parameter counts) or `uniform`. With
    `limit` (an accelerator's bytes), `profile` keeps each part's predicted memory within it."""
    from petatrain.train.pipeline import costs
    from petatrain.train.pipeline.layout import partition, uniform
    from petatrain.train.pipeline.memory import state_copies

    how = cfg.parallel.pipeline.partition
    if how == "auto":
        how = "profile" if profile is not None else "parameters"
    if how == "uniform":
        return uniform(n_blocks, parts)
    if how == "profile":
        if profile is None:
            raise ConfigError(
                "parallel.pipeline.partition profile: no layer profile of this model on this device; "
                "run `petatrain profile CONFIG --layers` first (or use parameters)"
            )
        if len(profile.units) != n_blocks + 2:
            raise ConfigError(f"the layer profile has {len(profile.units)} units; this model has {n_blocks + 2}")
        pc = cfg.parallel.pipeline
        copies = state_copies(cfg.train.optimizer, cfg.train.precision)
        memory = costs.unit_memory(profile, micro_batch, pc, replicas=replicas, copies=copies, tensor=tensor)
        return partition(profile.scaled(micro_batch), parts, memory=memory, limit=limit)
    return partition(parameter_costs(spec), parts)


def parameter_costs(spec: ModelSpec) -> list[float]:
    """Parameters per unit: the embedding's, each block's, the final norm and head's (a tied head counts)."""
    module, names = spec.module, spec.pipeline
    assert names is not None

    def params(mods: list[Any]) -> float:
        return float(sum(p.numel() for m in mods if m is not None for p in m.parameters()))

    return [
        params([getattr(module, n) for n in names.first]),
        *(params([b]) for b in getattr(module, names.blocks)),
        params([getattr(module, n) for n in names.last]),
    ]
