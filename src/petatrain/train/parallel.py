"""What the training loop calls to parallelize and checkpoint: the configured strategy's steps
(`train.strategies`), plus what every strategy shares.

State goes through `torch.distributed.checkpoint.state_dict` (parameter names as keys, no
pickle); which rank saves what, and how a checkpoint loads on another world size, is the
strategy's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from petatrain.config import JobConfig
from petatrain.errors import PetatrainError
from petatrain.models import ModelSpec
from petatrain.train import checkpoint as ckpt
from petatrain.train import strategies
from petatrain.train.strategies.base import ReadRankFile, StateDicts


def parallelize(spec: ModelSpec, cfg: JobConfig, device: torch.device) -> nn.Module:
    """The model on `device`, wrapped by parallel.strategy (one line refusing one `train` does not run)."""
    return strategies.of(cfg).wrap(spec, cfg, device)


def step_runner(spec: ModelSpec, cfg: JobConfig, device: torch.device, world: int) -> Any:
    """How a step runs on this rank under parallel.strategy (train/steps.py); `.model` is what it wrapped."""
    return strategies.of(cfg).steps(spec, cfg, device, world)


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
    strategy = strategies.of(cfg)
    if not isinstance(buffers.state_cache, StateDicts):
        buffers.state_cache = StateDicts()
    model_sd, optim_sd = strategy.state_dicts(model, optimizer, rank=rank, cfg=cfg, kept=buffers.state_cache)
    with_model = strategy.saves_model(rank, cfg)
    live_ptrs: frozenset[int] = frozenset()
    if live:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        live_ptrs = frozenset(_local(t).data_ptr() for t in [*model.parameters(), *state])
    return ckpt.flatten_state(model_sd, optim_sd, with_model=with_model, buffers=buffers, live_ptrs=live_ptrs)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def read_for_resume(
    state: ckpt.CheckpointState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int, cfg: JobConfig
) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors this rank loads from the checkpoint `state`, by rank file; `read(r)` reads
    (and verifies) rank r's file. Only the files this rank needs are read (`Strategy.read_for_resume`)."""
    strategy = strategies.of(cfg)
    by_name = state.strategy in strategies.BY_NAME and strategy.name in strategies.BY_NAME
    if state.strategy != strategy.name and not by_name:
        raise PetatrainError(
            f"checkpoint step {state.step} was written with parallel.strategy={state.strategy}; "
            f"this run uses {strategy.name}"
        )
    return strategy.read_for_resume(state, read, model=model, rank=rank, world=world)


def load_into(
    model,
    optimizer,
    state: ckpt.CheckpointState,
    shards: dict[int, dict[str, torch.Tensor]],
    *,
    rank: int,
    cfg: JobConfig,
):
    """Restore model and optimizer from the tensors `read_for_resume` gave (rank -> tensors)."""
    strategies.of(cfg).load_into(model, optimizer, state, shards, rank=rank)
