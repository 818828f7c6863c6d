"""The loader's sample order: a pure function of (shard sizes, seed, epoch).

The epoch's sequence S is built in two steps: shuffle the order of shards, then shuffle
positions inside consecutive windows of `window` samples (a window spans several
shards). Nothing depends on how many ranks or workers consume S, so a consumer layout
is just a way of dealing S out, and a saved position in S can be dealt out again to any
other layout.

Dealing: from a start position P (samples of this epoch already consumed by everyone),
rank r of R takes positions P + r, P + r + R, ...; within a rank, batch j of B local
samples goes to DataLoader worker j mod K, which is the order in which a DataLoader
with K workers hands batches back. So with all ranks in lockstep, the global position
after each rank consumed k samples is P + k * R, whatever R and K were.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key])))


@dataclass(frozen=True)
class Deal:
    """Which positions of S one rank consumes, from `start`, and how many."""

    start: int  # first global position of the deal (the saved position)
    rank: int
    world_size: int
    count: int  # samples this rank consumes from `start` to the end of the epoch
    dropped: int  # samples of the epoch tail nobody consumes (drop_last)

    def positions(self, first: int, stop: int) -> np.ndarray:
        """Global positions of this rank's local samples [first, stop)."""
        return self.start + self.rank + self.world_size * np.arange(first, min(stop, self.count), dtype=np.int64)


class SampleOrder:
    """Maps positions of the epoch's sequence to (shard, row in shard)."""

    def __init__(self, shard_rows: np.ndarray, *, seed: int, epoch: int, shuffle: bool, window: int):
        if window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {window}")
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.num_samples = int(self.shard_rows.sum())
        self.seed, self.epoch, self.shuffle, self.window = seed, epoch, shuffle, window
        n = len(self.shard_rows)
        self.shard_order = _rng(seed, epoch, 0x5A4D).permutation(n) if shuffle else np.arange(n)
        # ends[k] = number of samples in the first k+1 shards of the shuffled shard order
        self.ends = np.cumsum(self.shard_rows[self.shard_order])
        self._window_perm = lru_cache(maxsize=4)(self._make_window_perm)

    def _make_window_perm(self, w: int) -> np.ndarray:
        length = min(self.window, self.num_samples - w * self.window)
        return _rng(self.seed, self.epoch, w, 0x57494E).permutation(length)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard id, row within shard) for each position of S."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.shuffle and len(positions):
            first, last = int(positions[0] // self.window), int(positions[-1] // self.window)
            if first == last:  # the usual case for a batch: one window, positions ascending
                q = first * self.window + self._window_perm(first)[positions - first * self.window]
            else:
                q = np.empty_like(positions)
                windows = positions // self.window
                # A range, not np.unique: its first call imports numpy.ma (~50 ms per process).
                for w in range(min(first, last), max(first, last) + 1):
                    sel = windows == w
                    if sel.any():
                        q[sel] = w * self.window + self._window_perm(w)[positions[sel] - w * self.window]
        else:
            q = positions
        k = np.searchsorted(self.ends, q, side="right")
        before = np.where(k > 0, self.ends[np.maximum(k - 1, 0)], 0)
        return self.shard_order[k], q - before

    def deal(self, start: int, rank: int, world_size: int, *, drop_last: bool, batch_size: int = 1) -> Deal:
        """This rank's share of S[start:] (see `deal`)."""
        return deal(self.num_samples, start, rank, world_size, drop_last=drop_last, batch_size=batch_size)

    def window_shards(self, window: int) -> list[int]:
        """The shards positions [window·W, (window+1)·W) read, to load them ahead."""
        lo = window * self.window
        if lo >= self.num_samples:
            return []
        hi = min(lo + self.window, self.num_samples) - 1
        k0, k1 = np.searchsorted(self.ends, [lo, hi], side="right")
        return self.shard_order[k0 : k1 + 1].tolist()


def deal(num_samples: int, start: int, rank: int, world_size: int, *, drop_last: bool, batch_size: int = 1) -> Deal:
    """One rank's share of a sequence of `num_samples` positions, from `start`.

    Without drop_last every remaining sample is consumed once; ranks may differ by one
    sample. With drop_last the remainder is cut to a multiple of world_size *
    batch_size so every rank gets the same number of full batches; the cut tail is
    `dropped`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if not 0 <= start <= num_samples:
        raise ValueError(f"start position {start} is outside the epoch (0..{num_samples})")
    remaining = num_samples - start
    if drop_last:
        unit = world_size * batch_size
        kept = remaining // unit * unit
        return Deal(start, rank, world_size, kept // world_size, remaining - kept)
    count = remaining // world_size + (1 if rank < remaining % world_size else 0)
    return Deal(start, rank, world_size, count, 0)
