"""Pipeline parallelism (GPipe, 1F1B of Narayanan et al. 2021, interleaved, ZBV): the model cut into
stages, the global batch's micro-batches flowing through them; `parallel.pipeline.stages` x data-parallel
replicas = workers. `train` runs it through train/pipeline/ (torch.distributed.pipelining);
`plan` models pure pipelines (no replicas yet)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, cast

from petatrain.cost import formulas
from petatrain.errors import ConfigError, CorruptDataError
from petatrain.train.strategies.base import ReadRankFile, SavedState, StateLayout, Strategy, autocast_copies

if TYPE_CHECKING:
    import torch
    from torch import nn

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec

log = logging.getLogger(__name__)


class Pipeline(Strategy):
    name = "pipeline"
    trainable = True

    def data_parallel(self, count: int) -> int:
        return 1  # every stage sees the whole global batch

    def infeasible(self, w: Workload, count: int) -> str:
        if count < 2 or count > w.n_layer:
            return f"pipeline needs 2..{w.n_layer} stages (model.n_layer), not {count}"
        return ""

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        P, n = w.params, count
        stage_layers = math.ceil(w.n_layer / n)
        return StateLayout(
            weights=w.weight_width * P / n,
            gradients=w.grad_width * P / n,
            optimizer=w.optimizer_width * P / n,
            buffers=autocast_copies(w, stage_layers),
            stage_layers=stage_layers,
            in_flight=min(n, accumulation),  # 1F1B: the first stage holds p micro-batches
            optimizer_shards=n,
        )

    def communication_s(
        self, w: Workload, count: int, *, compute_s: float, accumulation: int, bandwidth: float
    ) -> tuple[float, float]:
        if count <= 1:
            return 0.0, 0.0
        # Activations forward and their gradients back across each stage boundary, per micro-batch.
        act_bytes = w.micro_batch * w.seq_len * w.d_model * w.activation_bytes_per_element
        return accumulation * 2 * act_bytes / bandwidth, compute_s * formulas.bubble_overhead(count, accumulation)

    # --- train ------------------------------------------------------------------------------
    def steps(self, spec: ModelSpec, cfg: JobConfig, device: torch.device, world: int) -> Any:
        import torch.distributed as dist

        from petatrain.train.pipeline import stages
        from petatrain.train.pipeline.layout import Layout
        from petatrain.train.steps import PipelineSteps

        pc = cfg.parallel.pipeline
        if spec.pipeline is None:
            raise ConfigError(
                f"model.kind {cfg.model.kind}: parallel.strategy pipeline needs a model that names its parts "
                "(return (module, loss_fn, PipelineParts) from the factory)"
            )
        layout = Layout.of(pc.stages, world, pc.chunks_per_rank(), pc.schedule)
        n_blocks = len(getattr(spec.module, spec.pipeline.blocks))
        plan = stages.PartPlan(tuple(_boundaries(spec, cfg, n_blocks, layout.parts)), n_blocks)
        piped = stages.build(
            spec.module, spec.pipeline, plan, layout, schedule=pc.schedule, microbatches=pc.microbatch_count(),
            device=device,
        )  # fmt: skip
        if dist.get_rank() == 0:
            log.info("pipeline parts (first unit of each): %s", list(plan.starts))
        return PipelineSteps(piped)

    def data_shard(self, cfg: JobConfig, rank: int, world: int) -> tuple[int, int, int]:
        """(loader rank, loader world, rows per `next()`): a replica's ranks read the same whole batch."""
        pc = cfg.parallel.pipeline
        replicas = world // pc.stages
        m, g = pc.microbatch_count(), cfg.train.global_batch
        if g % (replicas * m):
            raise ConfigError(
                f"train.global_batch {g} is not divisible by parallel.pipeline.microbatches {m} x {replicas} "
                f"data-parallel replicas (e.g. global_batch {replicas * m * max(1, g // (replicas * m))})"
            )
        return rank // pc.stages, replicas, g // replicas

    def saves_model(self, rank: int, cfg: JobConfig | None = None) -> bool:
        return cfg is not None and rank < cfg.parallel.pipeline.stages  # the first replica's ranks: one per part

    def read_for_resume(
        self, state: SavedState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every file that holds model state (one per part of the saved layout), merged by name, and
        this rank's own file at an unchanged world size (its RNG)."""
        merged: dict[str, torch.Tensor] = {}
        own: dict[str, torch.Tensor] = {}
        for r in range(state.world_size):
            tensors = read(r)
            if r == rank and state.world_size == world:
                own = tensors
            merged.update({k: v for k, v in tensors.items() if not k.startswith("rng/")})
        return {0: merged, rank: {**merged, **own}} if own else {0: merged}

    def load_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: SavedState,
        shards: dict[int, dict[str, torch.Tensor]],
        *,
        rank: int,
    ) -> None:
        """This rank's parameters and their optimizer state, by name, from the merged files."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from petatrain.train.checkpoint.tensors import unflatten_state

        model_sd, optim_state = unflatten_state(shards[0])
        wanted = get_model_state_dict(model)
        missing = sorted(set(wanted) - set(model_sd))
        if missing:
            raise CorruptDataError(f"checkpoint step has no tensors for {', '.join(missing[:3])}")
        set_model_state_dict(model, cast("dict[str, Any]", {k: model_sd[k] for k in wanted}))
        mine = {k: v for k, v in optim_state.items() if k in wanted}
        # The saved groups list rank 0's parameter names; this rank's groups hold its own, with the
        # saved hyperparameters (the groups are the recipe's, in its order: decayed, not decayed).
        current = cast("list[dict[str, Any]]", get_optimizer_state_dict(model, optimizer)["param_groups"])
        groups = [
            {**saved, "params": group["params"]} for group, saved in zip(current, state.param_groups, strict=True)
        ]
        set_optimizer_state_dict(model, optimizer, cast("Any", {"state": mine, "param_groups": groups}))


def _boundaries(spec: ModelSpec, cfg: JobConfig, n_blocks: int, parts: int) -> list[int]:
    """Where each part starts (in units: first, blocks, last), as parallel.pipeline.partition says."""
    from petatrain.train.pipeline.layout import partition, uniform

    how = cfg.parallel.pipeline.partition
    if how == "profile":
        raise ConfigError(
            "parallel.pipeline.partition profile: no per-block profile of this model yet; use parameters or uniform"
        )
    if how == "uniform":
        return uniform(n_blocks, parts)
    module, names = spec.module, spec.pipeline
    assert names is not None
    blocks = getattr(module, names.blocks)

    def params(mods: list[Any]) -> float:
        return float(sum(p.numel() for m in mods if m is not None for p in m.parameters()))

    costs = [
        params([getattr(module, n) for n in names.first]),
        *(params([b]) for b in blocks),
        params([getattr(module, n) for n in names.last]),
    ]
    return partition(costs, parts)
