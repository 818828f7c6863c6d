"""The attempt the run is on, and what the hub keeps per attempt: heartbeats, lost ranks, resizes; the run's stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple


class Attempt:
    """The current attempt's number and the one condition that every wait on the hub's state uses.

    A new attempt resets what belongs to the old one (`on_new`) and wakes every waiter: a waiter
    of a failed attempt gives up rather than take what the new one sends.
    """

    def __init__(self, clock: Callable[[], float] = time.time):
        self.cond = threading.Condition()
        self.number = -1
        self.clock = clock
        self._resets: list[Callable[[int], None]] = []

    def on_new(self, reset: Callable[[int], None]) -> None:
        """`reset(attempt)` runs, under the lock, whenever a new attempt starts."""
        self._resets.append(reset)

    def start(self, attempt: int) -> None:
        with self.cond:
            self.number = attempt
            for reset in self._resets:
                reset(attempt)
            self.cond.notify_all()


class Heartbeats:
    """Each rank's newest step in the current attempt and when it ended, on this node's clock."""

    def __init__(self, attempt: Attempt):
        self._attempt = attempt
        self.beats: dict[int, dict[str, Any]] = {}
        attempt.on_new(self._reset)

    def _reset(self, attempt: int) -> None:
        self.beats = {}

    def beat(self, attempt: int, rank: int, step: int, pid: int, node_id: str, age_s: float = 0.0) -> None:
        """A rank reached `step`, which ended `age_s` ago; "t" is when, on this node's clock
        (an age, not the worker's timestamp, so clocks of other nodes do not matter)."""
        current = self._attempt
        with current.cond:
            if attempt == current.number:
                self.beats[rank] = {"t": current.clock() - age_s, "step": step, "pid": pid, "node_id": node_id}
                current.cond.notify_all()  # a waiting watch() moves its hang deadline

    def snapshot(self) -> dict[int, dict[str, Any]]:
        with self._attempt.cond:
            return {rank: dict(beat) for rank, beat in self.beats.items()}

    def last_step_t(self) -> float | None:
        """When the newest step of the attempt ended; None before its first."""
        with self._attempt.cond:
            return max((b["t"] for b in self.beats.values() if b["step"] >= 0), default=None)

    def restart_clock(self) -> None:
        """Every rank counts as having beaten now (the hang clock starts again); the caller holds the lock."""
        now = self._attempt.clock()
        for beat in self.beats.values():
            beat["t"] = now


class Drain:
    """The ending attempt's lost ranks: while its survivors finish their checkpoint writes
    (`checkpoint.finish_writes`) no rank counts as hung, and a part one of the lost owed is given up."""

    def __init__(self, attempt: Attempt):
        self._attempt = attempt
        self.lost: set[int] = set()
        self.draining = False
        attempt.on_new(self._reset)

    def _reset(self, attempt: int) -> None:
        self.lost, self.draining = set(), False

    def attempt_failed(self, attempt: int, lost: list[int]) -> None:
        with self._attempt.cond:
            if attempt == self._attempt.number:
                self.lost, self.draining = set(lost), True
                self._attempt.cond.notify_all()


class Asked(NamedTuple):
    """The hub's answer to a rank's telemetry: what the driver asked of the attempt and the run."""

    resize: int | None  # restart on this many workers (the cluster grew back), after a checkpoint
    stop: bool  # end the run at the next step boundary, checkpointed, final weights written (TrainJob.stop)


class Resizes:
    """The worker count the driver asked each attempt to restart on (the cluster grew back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._to: dict[int, int] = {}

    def request(self, attempt: int, world: int) -> None:
        with self._lock:
            self._to[attempt] = world

    def asked(self, attempt: int) -> int | None:
        with self._lock:
            return self._to.get(attempt)
