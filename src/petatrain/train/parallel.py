"""Data parallelism (DDP) and fully sharded data parallelism (FSDP2), and their checkpoint state.

State goes through `torch.distributed.checkpoint.state_dict` (parameter names as keys,
no pickle): DDP replicas are identical, so only rank 0 saves model and optimizer
tensors; FSDP ranks save their own shards (dim-0 chunks, in rank order). An FSDP
checkpoint loads on the same world size shard by shard, and on another world size by
concatenating the shards into full tensors first.
"""

from __future__ import annotations

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
from petatrain.errors import ConfigError, PetatrainError
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


def ranks_to_read(state: dict[str, Any], *, rank: int, world: int, cfg: JobConfig) -> list[int]:
    """Whose rank files this rank needs to resume from the checkpoint `state`.

    DDP: rank 0's (the replicas' model and optimizer) and, at the same world size, its own
    (its RNG state). FSDP: its own shards at the same world size, every rank's otherwise."""
    if state.get("strategy") != cfg.parallel.strategy:
        raise PetatrainError(
            f"checkpoint step {state['step']} was written with parallel.strategy={state.get('strategy')}; "
            f"this run uses {cfg.parallel.strategy}"
        )
    same_world = state["world_size"] == world
    if cfg.parallel.strategy == "ddp":
        return sorted({0, rank}) if same_world else [0]
    return [rank] if same_world else list(range(state["world_size"]))


def load_into(model, optimizer, state: dict[str, Any], shards: dict[int, dict[str, torch.Tensor]], *, rank, world, cfg):
    """Restore model and optimizer from a checkpoint's verified rank files (`shards`: rank ->
    tensors, those `ranks_to_read` named), on any world size for FSDP and DDP."""
    groups = state["param_groups"]
    if cfg.parallel.strategy == "ddp":
        model_sd, optim_state = ckpt.unflatten_state(shards[0])
        set_model_state_dict(model, model_sd)
        set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups})
        return
    if state["world_size"] == world:
        model_sd, optim_state = ckpt.unflatten_state(shards[rank])
        current = get_model_state_dict(model)
        set_model_state_dict(model, {k: _like(current[k], v) for k, v in model_sd.items()})
        current_optim = get_optimizer_state_dict(model, optimizer)["state"]
        optim_state = {
            fqn: {k: _like(current_optim[fqn][k], v) if k in current_optim.get(fqn, {}) else v for k, v in s.items()}
            for fqn, s in optim_state.items()
        }
        set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups})
        return
    # Another world size: rebuild full tensors from every rank's dim-0 shards.
    parts_by_rank = [shards[r] for r in range(state["world_size"])]
    full: dict[str, torch.Tensor] = {}
    for name in parts_by_rank[0]:
        if name.startswith("rng/"):
            continue
        parts = [s[name] for s in parts_by_rank if name in s]
        full[name] = parts[0] if parts[0].dim() == 0 else torch.cat(parts, dim=0)
    model_sd, optim_state = ckpt.unflatten_state(full)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups}, options=options)


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
