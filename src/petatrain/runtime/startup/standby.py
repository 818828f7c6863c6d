"""The standby: the next attempt's trainer, its Ray Train controller started while this attempt trains."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Standby:
    """The next attempt's trainer, its Ray Train controller started while this attempt trains.

    A restart would otherwise begin by starting a controller process (Python, Ray, Ray Train
    and torch imports) before any worker could start. Once an attempt has made its first step,
    the watchdog asks for the next attempt's controller; it waits, idle, until a failure needs
    it (or the run ends and it is discarded). It is used only for the attempt number and world
    size it was built for: after a lost node the next attempt builds a controller for the
    workers that are left. Its start-up takes CPU: free where the driver's node has a core to
    spare, taken from the steps where every core trains (benchmarks/recovery.py weighs the two).
    `faults.standby: false` turns it off. With Ray Train's controller run by the driver (the
    default) there is no controller process to start, and nothing is prepared: the standby acts
    only where the controller is an actor (a Ray Client driver, `PETATRAIN_CONTROLLER=actor`).
    """

    def __init__(self, build: Callable[[int, int], Any], *, enabled: bool = True):
        self._build, self.enabled = build, enabled
        self._lock = threading.Lock()
        self._next: tuple[int, int, Any] | None = None  # (attempt, world size, prepared trainer)

    def prepare(self, attempt: int, world: int) -> None:
        """Called once `attempt` (on `world` workers) trains: start attempt + 1's controller."""
        with self._lock:
            self._discard()
            if not self.enabled:
                return
            trainer = self._build(attempt + 1, world)
            # The stock TorchTrainer (Ray's internals moved) starts on fit(); a driver's controller has no process.
            if hasattr(trainer, "prepare") and trainer.prepare():
                self._next = (attempt + 1, world, trainer)

    def take(self, attempt: int, world: int) -> Any:
        """The prepared trainer for this attempt and world size, or None (a fresh one is needed)."""
        with self._lock:
            if self._next is not None and self._next[:2] == (attempt, world):
                trainer, self._next = self._next[2], None
                return trainer
            self._discard()
            return None

    def discard(self) -> None:
        with self._lock:
            self._discard()

    def _discard(self) -> None:
        if self._next is not None:
            self._next[2].discard()
            self._next = None
