"""What the hang watchdog waits on: the ranks' progress (`HangWatch`), and the evaluation holds
(`EvalHold`) during which no rank counts as hung."""

from __future__ import annotations

from typing import Any

from petatrain.runtime.hub.attempt import Attempt, Drain, Heartbeats


class EvalHold:
    """Rank 0 waits after an evaluation until the driver releases its step (a search took it)."""

    def __init__(self, attempt: Attempt, beats: Heartbeats):
        self._attempt, self._beats = attempt, beats
        self.holding: int | None = None  # the step held
        self.released = -1  # the newest step released

    def hold(self, attempt: int, step: int) -> None:
        """Until `release(step)` or a new attempt: no hang meanwhile. A step released before (an
        attempt that trains it again after a restart) is not held."""
        current = self._attempt
        with current.cond:
            self.holding = step
            current.cond.notify_all()
            while self.released < step and attempt == current.number:
                current.cond.wait(1.0)
            self.holding = None
            self._beats.restart_clock()  # the hang clock starts again from the release
            current.cond.notify_all()

    def release(self, step: int) -> None:
        with self._attempt.cond:
            self.released = max(self.released, step)
            self._attempt.cond.notify_all()


class HangWatch:
    """The watchdog's long poll: answers once there is something to act on, or after its wait.

    Something to act on: a new attempt; the attempt's first step, unless `announced`; no step
    progress on any rank for `timeout_s` (three times that before the first step): then
    "stale_s" says for how long. No beat yet (the attempt is starting), a drain (a failed
    attempt's survivors finish their checkpoint writes) or an evaluation hold: nothing to call hung.
    A long poll, where the watchdog used to ask twice a second: ~0.004 cores fewer of the hub's
    and the driver's CPU on 2 cores, and a hang is returned when it is due.
    """

    def __init__(self, attempt: Attempt, beats: Heartbeats, drain: Drain, hold: EvalHold):
        self._attempt, self._beats, self._drain, self._hold = attempt, beats, drain, hold

    def watch(self, attempt: int, timeout_s: float, announced: bool, wait_s: float) -> dict[str, Any]:
        """{"beats": heartbeats, "stepped": bool, "stale_s": float | None}."""
        current = self._attempt
        end = current.clock() + wait_s
        with current.cond:
            while True:
                now, beats = current.clock(), self._beats.beats
                stepped = any(b["step"] >= 0 for b in beats.values())
                due, last = end, None
                if beats and not self._drain.draining and self._hold.holding is None:
                    last = max(b["t"] for b in beats.values())
                    due = min(end, last + (timeout_s if stepped else 3 * timeout_s))
                stale_s = now - last if last is not None and now >= due and due < end else None  # None unless hung
                if attempt != current.number or (stepped and not announced) or stale_s is not None or now >= end:
                    return {"beats": dict(beats), "stepped": stepped, "stale_s": stale_s}
                current.cond.wait(due - now)
