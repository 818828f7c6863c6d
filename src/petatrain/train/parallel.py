"""Data parallelism (DDP) and fully sharded data parallelism (FSDP2), and their checkpoint state.

State goes through `torch.distributed.checkpoint.state_dict` (parameter names as keys,
no pickle): DDP replicas are identical, so only rank 0 saves model and optimizer
tensors; FSDP ranks save their own shards (dim-0 chunks, in rank order). An FSDP
checkpoint loads on the same world size shard by shard, and on another world size from the
rows each new rank holds, copied out of the old ranks' files that hold them (`reshard`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from petatrain.config import JobConfig
from petatrain.errors import ConfigError, CorruptDataError, PetatrainError
from petatrain.models import ModelSpec
from petatrain.train import checkpoint as ckpt

TRAINABLE = ("ddp", "fsdp")


def parallelize(spec: ModelSpec, cfg: JobConfig, device: torch.device) -> nn.Module:
    strategy = cfg.parallel.strategy
    if strategy not in TRAINABLE:
        raise ConfigError(
            f"parallel.strategy {strategy!r}: train runs ddp or fsdp ({strategy} is modelled by `plan` only)"
        )
    model = spec.module.to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.train.precision == "bf16-mixed"
        else MixedPrecisionPolicy()
    )
    for module in model.modules():
        if spec.block_types and isinstance(module, spec.block_types):
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def state_for_save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    cfg: JobConfig,
    buffers: ckpt.HostBuffers,
    live: bool = False,
):
    """(tensors, json, live tensors) this rank writes, taken at a step boundary: host copies, or
    with `live` the parameters and optimizer state themselves (model buffers, which forward
    may update, are always copied)."""
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    with_model = cfg.parallel.strategy == "fsdp" or rank == 0
    live_ptrs: frozenset[int] = frozenset()
    if live:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        live_ptrs = frozenset(_local(t).data_ptr() for t in [*model.parameters(), *state])
    return ckpt.flatten_state(model_sd, optim_sd, with_model=with_model, buffers=buffers, live_ptrs=live_ptrs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def read_for_resume(
    state: dict[str, Any],
    read: Callable[[int], dict[str, torch.Tensor]],
    *,
    model: nn.Module,
    rank: int,
    world: int,
    cfg: JobConfig,
) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors this rank loads from the checkpoint `state`, by rank file; `read(r)` reads
    (and verifies) rank r's file.

    DDP: rank 0's file (the replicas' model and optimizer) and, at the same world size, its
    own (its RNG state). FSDP at the same world size: its own shards. FSDP at another world
    size: its dim-0 rows of every sharded tensor, copied out of the files of the old ranks that
    hold them, one file in memory at a time (not the whole checkpoint on every rank); returned
    as this rank's file."""
    if state.get("strategy") != cfg.parallel.strategy:
        raise PetatrainError(
            f"checkpoint step {state['step']} was written with parallel.strategy={state.get('strategy')}; "
            f"this run uses {cfg.parallel.strategy}"
        )
    same_world = state["world_size"] == world
    if cfg.parallel.strategy == "ddp":
        return {r: read(r) for r in sorted({0, rank} if same_world else {0})}
    if same_world:
        return {rank: read(rank)}
    return {rank: reshard(read, fsdp_rows(model, rank, world), state["world_size"])}


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [first, end) of a dim-0 size `rows` that `rank` of `world` holds under FSDP2, which
    splits as torch.chunk does: ceil(rows / world) each, the last ranks' short or empty."""
    size = -(-rows // world)
    first = min(rank * size, rows)
    return first, min(first + size, rows)


def fsdp_rows(model: nn.Module, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """parameter FQN -> (rows of the full tensor, first row this rank holds, end row), for every
    sharded parameter of an FSDP2 model (buffers are replicated and not listed)."""
    from torch.distributed.tensor import Shard

    out = {}
    for fqn, value in get_model_state_dict(model).items():
        if not hasattr(value, "to_local"):
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


def reshard(
    read: Callable[[int], dict[str, torch.Tensor]], rows: dict[str, tuple[int, int, int]], old_world: int
) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor of an FSDP checkpoint written by `old_world` ranks:
    for each sharded tensor (of a parameter in `rows`, as `fsdp_rows` gives them) the rows this
    rank holds, gathered from the old ranks' files that hold any of them; replicated tensors
    (buffers, step counts) from the first file read. Reads only those files, one at a time."""
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
            kind, fqn, _ = ckpt.split_name(name)
            if kind == "rng":
                continue  # per-rank streams of the old world: not this rank's
            if fqn not in rows or tensor.dim() == 0:
                out.setdefault(name, tensor)
                continue
            total, first, end = rows[fqn]
            old_first, old_end = chunk_rows(total, old_world, k)
            if tensor.shape[0] != old_end - old_first:
                raise CorruptDataError(
                    f"{ckpt.rank_file(k)}: {name} has {tensor.shape[0]} rows; {total} rows over {old_world} ranks "
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


def load_into(model, optimizer, state: dict[str, Any], shards: dict[int, dict[str, torch.Tensor]], *, rank, cfg):
    """Restore model and optimizer from the tensors `read_for_resume` gave (rank -> tensors)."""
    groups = state["param_groups"]
    if cfg.parallel.strategy == "ddp":
        model_sd, optim_state = ckpt.unflatten_state(shards[0])
        set_model_state_dict(model, model_sd)
        set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups})
        return
    model_sd, optim_state = ckpt.unflatten_state(shards[rank])  # this rank's shards, in this world
    current = get_model_state_dict(model)
    set_model_state_dict(model, {k: _like(current[k], v) for k, v in model_sd.items()})
    current_optim = get_optimizer_state_dict(model, optimizer)["state"]
    optim_state = {
        fqn: {k: _like(current_optim[fqn][k], v) if k in current_optim.get(fqn, {}) else v for k, v in s.items()}
        for fqn, s in optim_state.items()
    }
    set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups})


def _like(current: Any, saved: torch.Tensor) -> Any:
    """`saved` (this rank's local shard) shaped as `current` (a DTensor or a plain tensor)."""
    if hasattr(current, "to_local"):
        from torch.distributed.tensor import DTensor

        local = saved.to(current.to_local().device, current.dtype)
        return DTensor.from_local(
            local, current.device_mesh, current.placements, shape=current.shape, stride=current.stride()
        )
    return saved


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded weights on rank 0 (a collective for FSDP); separate CPU tensors."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in sd.items()}
