"""Parallelism strategies, by name (torchtitan's TrainSpec shape): each knows how `train` wraps
the model and lays out, reads and reshards its checkpoint, and how `plan` estimates its memory
and communication. A new strategy is a new file here and a line in `REGISTRY`.

    ddp       torch DDP                                 train, plan
    fsdp      FSDP2 fully_shard per block               train, plan
    zero1/2   ZeRO optimizer (+ gradient) partitioning  plan only
    pipeline  GPipe/1F1B/interleaved/ZBV over stages    train, plan (pure pipelines)
    tensor    Megatron TP + sequence parallel (DTensor)  train, plan (parallel.tensor > 1: replicas ddp or
                                                         fsdp; inside pipeline stages, the pipeline's)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from petatrain.errors import ConfigError
from petatrain.train.strategies.base import BY_NAME, OVERLAP, StateLayout, Strategy
from petatrain.train.strategies.ddp import DDP
from petatrain.train.strategies.fsdp import FSDP
from petatrain.train.strategies.pipeline import Pipeline
from petatrain.train.strategies.tensor import Tensor
from petatrain.train.strategies.zero import ZeRO1, ZeRO2

if TYPE_CHECKING:
    from petatrain.config import JobConfig

REGISTRY: dict[str, Strategy] = {s.name: s for s in (DDP(), ZeRO1(), ZeRO2(), FSDP(), Pipeline(), Tensor())}
TRAINABLE: tuple[str, ...] = tuple(name for name, s in REGISTRY.items() if s.trainable)

__all__ = ["BY_NAME", "OVERLAP", "REGISTRY", "TRAINABLE", "StateLayout", "Strategy", "get", "of", "sized"]


def get(name: str) -> Strategy:
    """The strategy called `name`; ConfigError naming the known ones otherwise."""
    strategy = REGISTRY.get(name)
    if strategy is None:
        raise ConfigError(f"parallel.strategy: unknown strategy {name!r} (one of {', '.join(REGISTRY)})")
    return strategy


def sized(cfg: JobConfig) -> Strategy:
    """The job's strategy with its shape, as `plan` estimates one (its degree, stages, replicas' strategy)."""
    if cfg.parallel.strategy == "pipeline":
        return Pipeline(cfg.parallel.pipeline.stages, cfg.parallel.pipeline.data, cfg.parallel.tensor)
    if cfg.parallel.tensor > 1:
        return Tensor(cfg.parallel.tensor, cfg.parallel.strategy)
    return get(cfg.parallel.strategy)


def of(cfg: JobConfig) -> Strategy:
    """The strategy a job trains under: tensor parallelism where parallel.tensor > 1 (its replicas
    under parallel.strategy), else parallel.strategy."""
    if cfg.parallel.tensor > 1 and cfg.parallel.strategy != "pipeline":  # a pipeline splits its own stages
        return REGISTRY["tensor"]
    return get(cfg.parallel.strategy)
