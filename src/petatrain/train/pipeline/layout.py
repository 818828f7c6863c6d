"""Who runs what in a pipeline job, and where the stage boundaries go (no torch: `plan` uses it too).

Ranks form a (dp, pp) grid with pp innermost, as torchtitan's mesh: rank = dp_rank x P + pp_rank; with
tensor parallelism a (dp, pp, tp) grid, tp innermost: rank = (dp_rank x P + pp_rank) x T + tp_rank.
The model is cut into P x v parts ("stages" in torch.distributed.pipelining's sense; v chunks per
rank): rank pp_rank runs parts pp_rank, pp_rank + P, ... ("loop" placement, interleaved 1F1B) or
pp_rank and 2P - 1 - pp_rank ("v" placement, ZBV), so the first and the last part share a rank.

The units the boundaries fall between are the model's prologue (the embedding: `first`), each of
its blocks, and its epilogue (the final norm and the head: `last`), each weighing what it costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from petatrain.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Layout:
    stages: int  # P: ranks a micro-batch passes through
    replicas: int  # D: data-parallel copies of the pipeline
    chunks: int  # v: model parts per rank
    style: str  # "loop" | "v"
    tensor: int = 1  # T: ranks that split each stage's layers (tensor parallelism)

    @classmethod
    def of(cls, stages: int, world: int, chunks: int, schedule: str, tensor: int = 1) -> Layout:
        if world % (stages * tensor):
            group = f" x parallel.tensor {tensor}" if tensor > 1 else ""
            raise ConfigError(f"parallel.workers {world} is not a multiple of parallel.pipeline.stages {stages}{group}")
        return cls(stages, world // (stages * tensor), chunks, "v" if schedule == "zbv" else "loop", tensor)

    @property
    def parts(self) -> int:
        return self.stages * self.chunks

    def pp_rank(self, rank: int) -> int:
        return rank // self.tensor % self.stages

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tensor * self.stages)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor

    def pp_group(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        return [(dp_rank * self.stages + p) * self.tensor + tp_rank for p in range(self.stages)]

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        return [(d * self.stages + pp_rank) * self.tensor + tp_rank for d in range(self.replicas)]

    def parts_of(self, pp_rank: int) -> list[int]:
        """The model parts a rank at pipeline position `pp_rank` runs, in schedule order."""
        if self.style == "v":
            return [pp_rank, 2 * self.stages - 1 - pp_rank]
        return [pp_rank + k * self.stages for k in range(self.chunks)]

    def rank_of_part(self, part: int, dp_rank: int, tp_rank: int = 0) -> int:
        pp = next(p for p in range(self.stages) if part in self.parts_of(p))
        return (dp_rank * self.stages + pp) * self.tensor + tp_rank


def units(n_blocks: int) -> list[str]:
    """The names of the units boundaries fall between: "first", "block.0" ... "block.N-1", "last"."""
    return ["first", *(f"block.{i}" for i in range(n_blocks)), "last"]


def partition(costs: Sequence[float], parts: int, *, memory: Sequence[float] = (), limit: float = 0.0) -> list[int]:
    """Boundaries cutting `costs` (one per unit, in order) into `parts` contiguous, non-empty parts so
    that the costliest part costs least (PipeDream's dynamic program for one replica per stage);
    with `limit`, no part's `memory` may exceed it. Returns the index of each part's first unit."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ConfigError(f"cannot cut {n} units into {parts} pipeline parts (need 1..{n})")
    prefix = list(itertools.accumulate(costs, initial=0.0))
    mem = list(itertools.accumulate(memory, initial=0.0)) if memory else None

    def cost(i: int, j: int) -> float:  # units [i, j)
        if mem is not None and limit and mem[j] - mem[i] > limit:
            return float("inf")
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best[k][j]: the least max-cost of cutting units [0, j) into k parts; cut[k][j] the last part's start.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[parts][n] == inf:
        raise ConfigError(
            f"no cut into {parts} parts keeps every part within its memory limit of {limit / 2**30:.2f} GiB "
            "(more parallel.pipeline.stages, or parallel.pipeline.data fsdp, would split it further)"
        )
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]


def uniform(n_blocks: int, parts: int) -> list[int]:
    """torchtitan's split: the blocks evenly by count (the first part also gets the embedding, the
    last the head), the remainder to the first parts."""
    if not 1 <= parts <= n_blocks:
        raise ConfigError(
            f"parallel.pipeline: {parts} pipeline parts need at least {parts} blocks, the model has {n_blocks}"
        )
    base, extra = divmod(n_blocks, parts)
    starts, first = [0], 1
    for k in range(parts - 1):
        first += base + (1 if k < extra else 0)
        starts.append(first)
    return starts


def part_costs(costs: Sequence[float], starts: Sequence[int]) -> list[float]:
    ends = [*starts[1:], len(costs)]
    return [sum(costs[a:b]) for a, b in zip(starts, ends, strict=True)]
