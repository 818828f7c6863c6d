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
from petatrain.train.strategies.base import ReadRankFile


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
    if type(strategy).state_dicts is strategies.base.Strategy.state_dicts:  # DDP, one process
        if not isinstance(buffers.state_cache, StateDicts):
            buffers.state_cache = StateDicts()
        model_sd, optim_sd = buffers.state_cache.get(model, optimizer)
    else:
        model_sd, optim_sd = strategy.state_dicts(model, optimizer, rank=rank, cfg=cfg)
    with_model = strategy.saves_model(rank, cfg)
    live_ptrs: frozenset[int] = frozenset()
    if live:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        live_ptrs = frozenset(_local(t).data_ptr() for t in [*model.parameters(), *state])
    return ckpt.flatten_state(model_sd, optim_sd, with_model=with_model, buffers=buffers, live_ptrs=live_ptrs)


class StateDicts:
    """`get_model_state_dict` and `get_optimizer_state_dict` of a module whose parameters are plain
    tensors, kept from one snapshot to the next: their generic machinery (names resolved through
    every wrapper, for every parameter) took 33 ms of a snapshot's stall for a 24-layer GPT here,
    more than the copy itself on a GPU. The kept dicts hold the very tensors the module and the
    optimizer update in place, so they stay current; they are taken again when any of those objects
    is not the same one (the optimizer's state loaded or first made, a parameter replaced), and the
    optimizer's param_groups (the learning rate) are read every time."""

    def __init__(self) -> None:
        self._key: list[int] = []
        self._sources: list[Any] = []  # held, so that no id in the key is reused
        self._model_sd: dict[str, Any] = {}
        self._state: dict[str, Any] = {}
        self._names: list[list[str]] = []  # each param group's parameter names

    def get(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        sources = self._sources_of(model, optimizer)
        key = [id(x) for x in sources]
        if key != self._key or any(hasattr(p, "to_local") for p in model.parameters()):
            self._model_sd = get_model_state_dict(model)
            optim_sd: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
            self._state = dict(optim_sd["state"])
            self._names = [list(g["params"]) for g in optim_sd["param_groups"]]
            self._key, self._sources = key, sources
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(optimizer.param_groups, self._names, strict=True)
        ]
        return dict(self._model_sd), {"state": dict(self._state), "param_groups": groups}

    @staticmethod
    def _sources_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
        """Every object the kept dicts stand for: the module's parameters and buffers, the optimizer's
        parameters, their state dicts and each tensor in them."""
        sources: list[Any] = [*model.parameters(), *model.buffers()]
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                sources.append(p)
                if state is not None:
                    sources.append(state)
                    sources.extend(state.values())
        return sources


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
