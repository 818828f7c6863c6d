"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced in buckets.

Checkpoint: the replicas are identical, so rank 0's file holds model and optimizer and the
other ranks' files only their RNG state. Resume reads rank 0's file (and, at the same world
size, its own for the RNG), or every file of a pipeline's or FSDP's checkpoint (base.read_by_name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from petatrain.cost import formulas
from petatrain.train.strategies.base import (
    OVERLAP,
    ReadRankFile,
    SavedState,
    StateLayout,
    Strategy,
    autocast_copies,
    load_by_name,
    read_by_name,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


def bucket_bytes(w: Workload, count: int) -> float:
    """Gradient buckets being all-reduced while backward goes on (none on one device)."""
    return min(2 * BUCKET_BYTES, w.grad_width * w.params) if count > 1 else 0.0


def allreduce_exposed_s(
    w: Workload, count: int, *, compute_s: float, bandwidth: float, params: float | None = None
) -> float:
    """The gradient all-reduce (ZeRO-1/2: reduce-scatter + all-gather, the same volume) that the
    backward pass, two thirds of the compute, does not hide; of `params` (default: the model's)."""
    comm = formulas.ring_allreduce_seconds(w.grad_width * (w.params if params is None else params), count, bandwidth)
    return max(0.0, comm - OVERLAP * compute_s * 2 / 3)


class DDP(Strategy):
    name = "ddp"
    trainable = True

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        P = w.params
        return StateLayout(
            weights=w.weight_width * P,
            gradients=w.grad_width * P,
            optimizer=w.optimizer_width * P,
            buffers=autocast_copies(w, w.n_layer) + bucket_bytes(w, count),
            stage_layers=w.n_layer,
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
        return allreduce_exposed_s(w, count, compute_s=compute_s, bandwidth=bandwidth), 0.0

    def checkpoint_bytes_per_device(self, total: float, count: int) -> float:
        return total  # rank 0 snapshots the whole replica

    def wrap(self, spec: ModelSpec, cfg: JobConfig, device: torch.device) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        model = spec.module.to(device)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def saves_model(self, rank: int, cfg: JobConfig | None = None) -> bool:
        return rank == 0

    def read_for_resume(
        self, state: SavedState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int
    ) -> dict[int, dict[str, torch.Tensor]]:
        if state.strategy != self.name:  # a pipeline's (parts in several files) or FSDP's (rows)
            from petatrain.models import tied_names

            return read_by_name(state, read, rank=rank, world=world, ties=tied_names(model))
        return {r: read(r) for r in sorted({0, rank} if state.world_size == world else {0})}

    def load_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: SavedState,
        shards: dict[int, dict[str, torch.Tensor]],
        *,
        rank: int,
    ) -> None:
        from petatrain.models import tied_names

        load_by_name(model, optimizer, state, shards[0], tied_names(model))
