"""The pass that carries a run's data position from dataset version v onto a later version w.

What a continued run reads first, as one sequence S of `num_samples` positions (a pure function of
the shards' row counts, the seed, where the run was in v and the replay share, like every order the
loader deals out):

- every row that (v, w] added, exactly once, in a shuffled order of the new shards (the same
  shard-then-window shuffle as any epoch);
- mixed in evenly, a `replay` share of S drawn from the rows of v: the run's own sequence over v,
  continued from the exact position it had reached (epoch e, position p), so that no row of v it
  read in this pass is read again before the pass is over, and on into v's next epochs if the
  replay needs more rows than were left.

Position i of S is a replay iff floor((i+1)·R/L) > floor(i·R/L), with R replayed rows in L, so
every batch holds its share to within one row, at any world size: the layout only deals S out.
The state that resumes S is four numbers (the pass's epoch, v's epoch and position at the switch,
and the position in S), never a list of rows.

After S the run reads w whole, epoch by epoch, as any run does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from petatrain.data.loading.order import Deal, SampleOrder, deal

# The new rows' shuffle is seeded apart from every epoch of a run's own sequence.
_NEW_ROWS_SALT = 1 << 40


@dataclass(frozen=True, slots=True)
class Switch:
    """Where a run's sequence over version v was when it continued onto a later version."""

    from_version: int
    old_shards: int  # the shards of v (the first shards of every later version)
    epoch: int  # v's epoch it was in (the pass takes its number; w's epochs follow it)
    position: int  # samples of that epoch already read
    replay: float  # the share of the pass drawn from v's rows
    window: int  # the shuffle window of the run's sequence over v (its continuation needs the same)

    def to_json(self) -> dict[str, int | float]:
        return {
            "from_version": self.from_version,
            "old_shards": self.old_shards,
            "epoch": self.epoch,
            "position": self.position,
            "replay": self.replay,
            "window": self.window,
        }

    @classmethod
    def from_json(cls, raw: object) -> Switch:
        """The switch a loader state records; ValueError for anything that is not one."""
        if not isinstance(raw, dict) or set(raw) != set(cls.__slots__):
            raise ValueError(f"loader state continuation {str(raw)[:80]} is not a record of a switch")
        counts = ("from_version", "old_shards", "epoch", "position", "window")
        if not all(type(raw[k]) is int and raw[k] >= 0 for k in counts) or raw["window"] < 1:
            raise ValueError(f"loader state continuation {str(raw)[:80]} holds a value that is not a count")
        if type(raw["replay"]) not in (int, float) or not 0 <= raw["replay"] < 1:
            raise ValueError(f"loader state continuation replay {raw['replay']!r} is not a share in [0, 1)")
        return cls(**raw)


def replayed(new: int, old: int, replay: float) -> int:
    """Rows of v the pass replays beside `new` new rows: a `replay` share of the pass (none without old rows)."""
    if replay <= 0 or old <= 0 or new <= 0:
        return 0
    return math.floor(new * replay / (1.0 - replay))


class ContinuedOrder:
    """Positions of the continuation pass -> (shard of w, row within the shard), as SampleOrder maps
    an epoch's positions. `old_rows`: v's shards' (training) rows; `new_rows`: the added shards'."""

    def __init__(
        self,
        old_rows: np.ndarray,
        new_rows: np.ndarray,
        *,
        switch: Switch,
        to_version: int,
        seed: int,
        shuffle: bool,
        window: int,
    ):
        self.old_rows, self.new_rows = np.asarray(old_rows, np.int64), np.asarray(new_rows, np.int64)
        self.switch, self.seed, self.shuffle, self.window = switch, seed, shuffle, window
        self.epoch = switch.epoch  # the pass is this epoch of the continued run
        self.old_count, self.new_count = int(self.old_rows.sum()), int(self.new_rows.sum())
        if not 0 <= switch.position <= self.old_count:
            raise ValueError(f"the switch position {switch.position} is outside version {switch.from_version}")
        self.replay_count = replayed(self.new_count, self.old_count, switch.replay)
        self.num_samples = self.new_count + self.replay_count
        self.new = SampleOrder(
            self.new_rows, seed=seed, epoch=_NEW_ROWS_SALT + to_version, shuffle=shuffle, window=window
        )
        self._old = lru_cache(maxsize=4)(self._old_order)

    def _old_order(self, epoch: int) -> SampleOrder:
        return SampleOrder(self.old_rows, seed=self.seed, epoch=epoch, shuffle=self.shuffle, window=self.switch.window)

    # -- which positions replay ----------------------------------------------------------------
    def replays_before(self, positions: np.ndarray) -> np.ndarray:
        """How many of the positions before each one are replays."""
        if not self.num_samples:
            return np.zeros_like(positions)
        return positions * self.replay_count // self.num_samples

    def split(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(is a replay, index among the replays or among the new rows) for each position."""
        positions = np.asarray(positions, dtype=np.int64)
        before = self.replays_before(positions)
        replay = self.replays_before(positions + 1) > before
        return replay, np.where(replay, before, positions - before)

    def _old_positions(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(v's epoch, position in it) of the k-th replayed row: v's sequence continued from the switch."""
        q = self.switch.position + k
        return self.switch.epoch + q // self.old_count, q % self.old_count

    # -- SampleOrder's interface --------------------------------------------------------------
    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard of w, row within the shard) for each position of the pass."""
        positions = np.asarray(positions, dtype=np.int64)
        replay, index = self.split(positions)
        shards = np.empty(len(positions), dtype=np.int64)
        rows = np.empty(len(positions), dtype=np.int64)
        fresh = ~replay
        if fresh.any():
            s, r = self.new.locate(index[fresh])
            shards[fresh], rows[fresh] = s + len(self.old_rows), r
        if replay.any():
            epochs, where = self._old_positions(index[replay])
            picked = np.flatnonzero(replay)
            for epoch in range(int(epochs.min()), int(epochs.max()) + 1):
                mine = epochs == epoch
                if mine.any():
                    s, r = self._old(epoch).locate(where[mine])
                    shards[picked[mine]], rows[picked[mine]] = s, r
        return shards, rows

    def window_shards(self, window: int) -> list[int]:
        """The shards of w that positions [window·W, (window+1)·W) read, to load them ahead."""
        lo = window * self.window
        hi = min(lo + self.window, self.num_samples)
        if lo >= hi:
            return []
        shards, _ = self.locate(np.arange(lo, hi, dtype=np.int64))
        return list(dict.fromkeys(shards.tolist()))

    def deal(self, start: int, rank: int, world_size: int, *, drop_last: bool, batch_size: int = 1) -> Deal:
        return deal(self.num_samples, start, rank, world_size, drop_last=drop_last, batch_size=batch_size)
