"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced in buckets.

Checkpoint: the replicas are identical, so rank 0's file holds model and optimizer and the
other ranks' files only their RNG state. Resume reads rank 0's file (and, at the same world
size, its own for the RNG).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from petatrain.cost import formulas
from petatrain.train.strategies.base import OVERLAP, ReadRankFile, SavedState, StateLayout, Strategy, autocast_copies

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import DictValueType, OptimizerStateType, ValueType

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


def bucket_bytes(w: Workload, count: int) -> float:
    """Gradient buckets being all-reduced while backward goes on (none on one device)."""
    return min(2 * BUCKET_BYTES, w.grad_width * w.params) if count > 1 else 0.0


def allreduce_exposed_s(w: Workload, count: int, *, compute_s: float, bandwidth: float) -> float:
    """The gradient all-reduce (ZeRO-1/2: reduce-scatter + all-gather, the same volume) that the
    backward pass, two thirds of the compute, does not hide."""
    comm = formulas.ring_allreduce_seconds(w.grad_width * w.params, count, bandwidth)
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
        self, w: Workload, count: int, *, compute_s: float, accumulation: int, bandwidth: float
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
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from petatrain.train.checkpoint.tensors import unflatten_state

        model_sd, optim_state = unflatten_state(shards[0])
        # DCP types state dicts as dict[str, ValueType] (a union, in an invariant dict), which a
        # dict of tensors is at run time but not to a type checker.
        set_model_state_dict(model, cast("dict[str, ValueType]", model_sd))
        optim_sd: OptimizerStateType = {"state": cast("DictValueType", optim_state), "param_groups": state.param_groups}
        set_optimizer_state_dict(model, optimizer, optim_sd)
