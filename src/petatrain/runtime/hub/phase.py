"""What the hub learns from the events as they pass: the run's phase (for the health endpoint)
and the attempts' placement groups (for a later driver to remove, should this one die)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from petatrain.observe import events as ev


class RunPhase:
    """The run's state (starting, training, checkpointing, restarting, finished, failed), when it
    started, when the attempt started and its newest step: what `runtime.health` reports."""

    # The state each event puts the run in (an end: finished or failed).
    STATES: ClassVar[dict[str, str]] = {
        "run_start": "starting",
        "run_continue": "starting",
        "attempt_start": "starting",
        "step": "training",
        "checkpoint_snapshot": "checkpointing",
        "checkpoint_commit": "training",
        "checkpoint_skipped": "training",
        "failure": "restarting",
        "restart": "restarting",
    }

    def __init__(self, clock: Callable[[], float] = time.time):
        self._lock = threading.Lock()
        self.phase: dict[str, Any] = {"state": "starting", "started_t": clock(), "attempt_t": None, "step": None}

    def track(self, event: ev.Event) -> None:
        with self._lock:
            phase = self.phase
            if isinstance(event, ev.End):
                phase["state"] = "finished" if event.status == "ok" else "failed"
            elif isinstance(event, ev.AttemptStart) and phase["state"] == "restarting":
                pass  # restarting until the new attempt's first step
            elif event.kind in self.STATES:
                phase["state"] = self.STATES[event.kind]
            if isinstance(event, ev.AttemptStart):
                phase["attempt_t"], phase["step"] = event.t, None  # steps of this attempt
            if isinstance(event, ev.Step):
                phase["step"] = max(phase["step"] or 0, event.step)

    def health(self, attempt: int, last_step_t: float | None) -> dict[str, Any]:
        """The run's state for the driver's health endpoint: state, attempt, newest step and when."""
        with self._lock:
            return {**self.phase, "attempt": attempt, "last_step_t": last_step_t}


class PlacementGroups:
    """The placement groups the attempts' ranks ran in (their worker_start events)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    def track(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorkerStart) and event.placement_group:
            with self._lock:
                self._ids.add(event.placement_group)

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._ids)
