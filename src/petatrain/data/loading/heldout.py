"""The held-out evaluation rows of a dataset, stable across its versions.

Every `every`-th row of a shard is held out, from a first row that a hash of the shard's number
picks (`every = round(1 / data.eval_fraction)`). A committed shard never changes and keeps its
number, and a new version only adds shards, so a row held out in version v is held out in every
later version, and each new version adds held-out rows of its own in proportion: evaluation data
never becomes training data. (The split by the last shards, which datasets were evaluated on
before, moved with every append: `data.eval_split: shards` keeps it for the runs that use it.)

Everything is arithmetic on counts: how many rows of a shard train and how many are held out, and
which row the k-th of either is, vectorised, O(1) per row and with no per-row list, so a loader
over millions of shards starts as fast as without a split.
"""

from __future__ import annotations

import numpy as np

MAX_FRACTION = 0.5  # every second row: beyond that the "held-out" rows would be the majority


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 of each value: a stable hash, vectorised (uint64 arithmetic wraps)."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class HeldOut:
    """Which rows of each shard are held out at `fraction`; `rows[i]` is the row count of shard
    number `first_shard + i` of the dataset."""

    def __init__(self, rows: np.ndarray, fraction: float, *, first_shard: int = 0):
        if not 0.0 <= fraction <= MAX_FRACTION:
            raise ValueError(f"data.eval_fraction must be in [0, {MAX_FRACTION}], got {fraction}")
        self.rows = np.asarray(rows, dtype=np.int64)
        self.every = round(1 / fraction) if fraction > 0 else 0
        numbers = np.arange(first_shard, first_shard + len(self.rows), dtype=np.int64)
        with np.errstate(over="ignore"):
            self.first = (_mix(numbers) % np.uint64(max(self.every, 1))).astype(np.int64)

    def eval_counts(self) -> np.ndarray:
        """Held-out rows per shard."""
        if not self.every:
            return np.zeros(len(self.rows), dtype=np.int64)
        n, t = self.rows, self.first
        return np.where(n > t, (n - 1 - t) // self.every + 1, 0)

    def train_counts(self) -> np.ndarray:
        """Training rows per shard."""
        return self.rows - self.eval_counts()

    def train_row(self, shards: np.ndarray, k: np.ndarray) -> np.ndarray:
        """The row of each shard that is its k-th training row."""
        k = np.asarray(k, dtype=np.int64)
        if not self.every:
            return k
        if self.every == 1:
            raise ValueError("every row is held out")
        t = self.first[np.asarray(shards, dtype=np.int64)]
        after = k - t  # the training rows after the first held-out one come in runs of every - 1
        return np.where(k < t, k, t + 1 + after + after // (self.every - 1))

    def eval_row(self, shards: np.ndarray, k: np.ndarray) -> np.ndarray:
        """The row of each shard that is its k-th held-out row."""
        k = np.asarray(k, dtype=np.int64)
        return self.first[np.asarray(shards, dtype=np.int64)] + k * self.every
