"""FSDP2 (`fully_shard` per transformer block, then the root): weights, gradients and optimizer
states sharded over the ranks (ZeRO-3); blocks all-gathered for forward and backward.

Checkpoint: every rank saves its own shards (dim-0 chunks, in rank order). At the same world
size each rank loads its own file; at another, each rank copies the rows it now holds out of
the old ranks' files that hold them, one file in memory at a time (`reshard`). A DDP or pipeline
checkpoint (whole tensors by name) loads as this rank's rows of them (`rows_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from petatrain.cost import formulas
from petatrain.errors import ConfigError, CorruptDataError, PetatrainError
from petatrain.train.strategies.base import (
    OVERLAP,
    ReadRankFile,
    SavedState,
    StateLayout,
    Strategy,
    alias_ties,
    read_by_name,
    this_models_groups,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import DictValueType, OptimizerStateType

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec


class FSDP(Strategy):
    name = "fsdp"
    trainable = True
    every_rank_writes = True

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        P, n, unit = w.params, count, w.layer_params
        buffers = 0.0
        if n > 1:
            buffers += 2 * unit * w.gathered_width  # the gathered current block + the prefetched one
            buffers += unit * w.grad_width  # the block's unsharded gradient before reduce-scatter
        return StateLayout(
            weights=w.weight_width * P / n,
            gradients=w.grad_width * P / n,
            optimizer=w.optimizer_width * P / n,
            buffers=buffers,  # no autocast copies: the gathered blocks are bf16 already
            stage_layers=w.n_layer,
            grad_shards=n,
            optimizer_shards=n,
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
        return sharded_exposed_s(
            w, count, w.params, compute_s=compute_s, accumulation=accumulation, bandwidth=bandwidth
        ), 0.0

    def wrap(self, spec: ModelSpec, cfg: JobConfig, device: torch.device) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        model = spec.module.to(device)
        policy = precision_policy(cfg)
        for module in model.modules():
            if spec.block_types and isinstance(module, spec.block_types):
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    def read_for_resume(
        self, state: SavedState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int
    ) -> dict[int, dict[str, torch.Tensor]]:
        if state.strategy != self.name:  # whole tensors by name (DDP's, a pipeline's): this rank's rows of them
            from petatrain.models import tied_names

            ties = tied_names(model)
            whole = read_by_name(state, read, rank=rank, world=world, ties=ties)
            return {rank: rows_of(whole.get(rank, whole[0]), model, rank, world, ties)}
        if state.world_size == world:
            return {rank: read(rank)}
        return {rank: reshard(read, fsdp_rows(model, rank, world), state.world_size)}

    def load_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: SavedState,
        shards: dict[int, dict[str, torch.Tensor]],
        *,
        rank: int,
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from petatrain.train.checkpoint.tensors import unflatten_state

        model_sd, optim_state = unflatten_state(shards[rank])  # this rank's shards, in this world
        current = get_model_state_dict(model)
        set_model_state_dict(model, {k: _like(current[k], v) for k, v in model_sd.items()})
        # DCP types both entries of an optimizer state dict alike; "state" is FQN -> name -> value.
        current_optim = cast("dict[str, DictValueType]", get_optimizer_state_dict(model, optimizer)["state"])
        resumed: DictValueType = {
            fqn: {k: _like(current_optim[fqn][k], v) if k in current_optim.get(fqn, {}) else v for k, v in s.items()}
            for fqn, s in optim_state.items()
        }
        optim_sd: OptimizerStateType = {"state": resumed, "param_groups": this_models_groups(model, optimizer, state)}
        set_optimizer_state_dict(model, optimizer, optim_sd)


def sharded_exposed_s(
    w: Workload, count: int, params: float, *, compute_s: float, accumulation: int, bandwidth: float
) -> float:
    """FSDP's traffic over `count` shards of `params` parameters that the compute does not hide: an
    all-gather for forward and one for backward, a reduce-scatter of the gradients, per micro-batch."""
    gather = formulas.ring_collective_seconds(w.gathered_width * params, count, bandwidth)
    reduce = formulas.ring_collective_seconds(w.grad_width * params, count, bandwidth)
    return max(0.0, accumulation * (2 * gather + reduce) - OVERLAP * compute_s)


def precision_policy(cfg: JobConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy for train.precision: bf16 gathers and fp32 reductions, or none."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.train.precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _like(current: Any, saved: torch.Tensor) -> Any:
    """`saved` (this rank's local shard) shaped as `current` (a DTensor or a plain tensor)."""
    if hasattr(current, "to_local"):
        from torch.distributed.tensor import DTensor

        local = saved.to(current.to_local().device, current.dtype)
        return DTensor.from_local(
            local, current.device_mesh, current.placements, shape=current.shape, stride=current.stride()
        )
    return saved


def rows_of(
    whole: dict[str, torch.Tensor], model: nn.Module, rank: int, world: int, ties: list[list[str]]
) -> dict[str, torch.Tensor]:
    """This rank's rows of whole tensors by name (flat names, as a rank file holds them), for the
    names this FSDP model has: each parameter's under every tied name, its optimizer state under the
    name the optimizer uses; buffers, step counts and RNG as they are."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from petatrain.train.checkpoint.tensors import split_name, unflatten_state

    model_sd, optim_state = unflatten_state(whole)
    alias_ties(model_sd, optim_state, ties)
    rows = fsdp_rows(model, rank, world)
    names = set(get_model_state_dict(model))
    params = {name for name, _ in model.named_parameters()}

    def mine(fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        if fqn in rows and tensor.dim() > 0:
            _, first, end = rows[fqn]
            return tensor[first:end].clone()
        return tensor

    out = {f"model/{fqn}": mine(fqn, t) for fqn, t in model_sd.items() if fqn in names}
    out |= {f"optim/{fqn}/{k}": mine(fqn, t) for fqn, s in optim_state.items() if fqn in params for k, t in s.items()}
    out |= {name: t for name, t in whole.items() if split_name(name)[0] == "rng"}
    missing = sorted(names - set(model_sd))
    if missing:
        raise CorruptDataError(f"the checkpoint holds no tensor for {', '.join(missing[:3])}")
    return out


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [first, end) of a dim-0 size `rows` that `rank` of `world` holds under FSDP2, which
    splits as torch.chunk does: ceil(rows / world) each, the last ranks' short or empty."""
    size = -(-rows // world)
    first = min(rank * size, rows)
    return first, min(first + size, rows)


def fsdp_rows(model: nn.Module, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """parameter FQN -> (rows of the full tensor, first row this rank holds, end row), for every
    sharded parameter of an FSDP2 model (buffers are replicated and not listed)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for fqn, value in get_model_state_dict(model).items():
        if not isinstance(value, DTensor):  # a buffer
            continue
        if tuple(value.placements) != (Shard(0),):
            raise ConfigError(f"{fqn}: placements {value.placements}; only dim-0 FSDP shards can be re-sharded")
        first, end = chunk_rows(value.shape[0], world, rank)
        if end - first != value.to_local().shape[0]:
            raise PetatrainError(
                f"{fqn}: rank {rank} of {world} holds {value.to_local().shape[0]} rows of {value.shape[0]}, "
                f"not the {end - first} FSDP2's chunking gives"
            )
        out[fqn] = (value.shape[0], first, end)
    return out


def reshard(read: ReadRankFile, rows: dict[str, tuple[int, int, int]], old_world: int) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor of an FSDP checkpoint written by `old_world` ranks:
    for each sharded tensor (of a parameter in `rows`, as `fsdp_rows` gives them) the rows this
    rank holds, gathered from the old ranks' files that hold any of them; replicated tensors
    (buffers, step counts) from the first file read. Reads only those files, one at a time."""
    from petatrain.train.checkpoint.layout import rank_file
    from petatrain.train.checkpoint.tensors import split_name

    wanted = {
        k
        for total, first, end in rows.values()
        for k in range(old_world)
        if _overlap((first, end), chunk_rows(total, old_world, k))
    }
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for k in sorted(wanted) or [0]:  # a rank holding no rows still needs the replicated tensors
        for name, tensor in read(k).items():
            kind, fqn, _ = split_name(name)
            if kind == "rng":
                continue  # per-rank streams of the old world: not this rank's
            if fqn not in rows or tensor.dim() == 0:
                out.setdefault(name, tensor)
                continue
            total, first, end = rows[fqn]
            old_first, old_end = chunk_rows(total, old_world, k)
            if tensor.shape[0] != old_end - old_first:
                raise CorruptDataError(
                    f"{rank_file(k)}: {name} has {tensor.shape[0]} rows; {total} rows over {old_world} ranks "
                    f"gives it {old_end - old_first}"
                )
            if name not in out:
                out[name], filled[name] = tensor.new_empty((end - first, *tensor.shape[1:])), 0
            both = _overlap((first, end), (old_first, old_end))
            if both:
                a, b = both
                out[name][a - first : b - first] = tensor[a - old_first : b - old_first]
                filled[name] += b - a
    short = sorted(name for name, got in filled.items() if got != out[name].shape[0])
    if short:
        raise CorruptDataError(f"rows missing from the old ranks' files for {', '.join(short[:3])}")
    return out


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    first, end = max(a[0], b[0]), min(a[1], b[1])
    return (first, end) if first < end else None
