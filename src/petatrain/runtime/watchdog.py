"""The hang watchdog: a driver thread that reads the ranks' step heartbeats from the run hub."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from petatrain.runtime.failures import Failure, FailureCause

log = logging.getLogger(__name__)


class Watchdog:
    """Declares a hang when no rank has made step progress for `timeout_s`, and kills the group.

    Killing the stuck processes (SIGKILL through a task on their node) turns a hang into a
    worker death that Ray Train reports at once, instead of a collective that waits for
    its timeout. Until the first step the allowance is three times longer (start-up, resume).
    Once an attempt has stepped, `on_training(attempt, world_size)` is called (once). It
    waits on the hub's long poll (`RunHub.watch`: hub/watch.py), which answers when one of these is due.
    A hub that does not answer is logged (once per outage): without it, hangs go undetected.

    With `grow` (the worker count the alive cluster could host now, if more than the attempt's, else
    None), each answer of an attempt that runs fewer workers than `most` (the top of `parallel.workers`)
    asks whether the cluster grew back, and the hub holds such an attempt's call GROW_POLL_S instead of
    WAIT_S: a node that joins is used within seconds. Then the hub tells the attempt's rank 0
    (`RunHub.request_resize`), once per attempt, and the ranks stop together after a checkpoint so the
    next attempt runs on more workers.
    """

    WAIT_S = 10.0  # the longest the hub holds a watch() call
    GROW_POLL_S = 2.0  # ... while the attempt could grow: how soon a node that joined is seen
    RETRY_S = 0.5  # after a failed watch() call

    def __init__(
        self,
        hub: Any,
        timeout_s: float,
        on_training: Callable[[int, int], None] | None = None,
        kill_group: Callable[[dict[int, dict[str, Any]]], None] | None = None,
        grow: Callable[[int], int | None] | None = None,
        most: int | None = None,
    ):
        self.hub, self.timeout_s, self.on_training, self.grow = hub, timeout_s, on_training, grow
        self.most = most  # the most workers a run may have (the top of parallel.workers); None: not known
        self._resize_asked = -1  # the attempt a resize was requested for
        self.kill_group = kill_group or _kill_group
        self.verdict: Failure | None = None
        self.failed_calls = 0  # consecutive watch() calls that raised
        self._attempt, self._world, self._announced = -1, 0, True
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="petatrain-watchdog", daemon=True)
        self._thread.start()

    def start(self, attempt: int, world: int = 0) -> None:
        self.verdict, self._attempt, self._world = None, attempt, world
        self._announced = self.on_training is None
        self._active.set()

    def pause(self) -> None:
        self._active.clear()

    def stop(self) -> None:
        self._stop.set()
        self._active.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._active.wait()
            attempt, announced = self._attempt, self._announced
            if self._stop.is_set() or self.verdict is not None:  # a hung attempt ends: wait for the next
                self._stop.wait(self.RETRY_S)
                continue
            seen = self._poll(attempt, announced)
            if seen is None or not self._active.is_set() or attempt != self._attempt:
                continue
            if seen["stale_s"] is not None:
                self._declare_hang(seen)
                continue
            if seen["stepped"]:
                self._maybe_grow(attempt)
            if seen["stepped"] and not self._announced:
                self._announced = True
                assert self.on_training is not None  # without one, start() leaves the attempt announced
                try:
                    self.on_training(self._attempt, self._world)
                except Exception:  # a standby is an optimisation: the next attempt starts cold
                    log.warning("preparing the next attempt failed", exc_info=True)

    def _poll(self, attempt: int, announced: bool) -> dict[str, Any] | None:
        """The hub's answer (returns when there is something to act on, or after WAIT_S); None if it failed."""
        import ray

        wait_s = self.GROW_POLL_S if self._could_grow(attempt) else self.WAIT_S
        try:
            call = self.hub.watch.remote(attempt, self.timeout_s, announced, wait_s)
            seen = ray.get(call, timeout=wait_s + 5)
        except Exception as exc:
            if self._stop.is_set():  # the run is ending and its hub is closed: nothing is missed
                return None
            self.failed_calls += 1
            if self.failed_calls == 1:  # once per outage, not every half second
                log.warning("hang watchdog: the run hub did not answer (%s); hangs go undetected until it does", exc)
            else:
                log.debug("hang watchdog: the run hub still does not answer", exc_info=True)
            self._stop.wait(self.RETRY_S)
            return None
        if self.failed_calls:
            log.info("hang watchdog: the run hub answers again after %d failed call(s)", self.failed_calls)
            self.failed_calls = 0
        return seen

    def _could_grow(self, attempt: int) -> bool:
        """A resize is possible and not yet asked: the attempt runs fewer workers than the run may have."""
        below_top = self.most is None or self._world < self.most
        return self.grow is not None and self._resize_asked != attempt and below_top

    def _maybe_grow(self, attempt: int) -> None:
        if not self._could_grow(attempt):  # at the top of the range: the cluster is not even asked
            return
        assert self.grow is not None  # _could_grow says so
        try:
            world = self.grow(self._world)
        except Exception:  # the cluster's state could not be read: ask again at the next answer
            log.debug("could not read the cluster's resources", exc_info=True)
            return
        if world is not None:
            self._resize_asked = attempt
            log.info("the cluster can host %d workers again (this attempt runs %d): resizing after a checkpoint",
                     world, self._world)  # fmt: skip
            self.hub.request_resize.remote(attempt, world)

    def _declare_hang(self, seen: dict[str, Any]) -> None:
        beats = seen["beats"]
        rank, beat = min(beats.items(), key=lambda kv: (kv[1]["step"], kv[1]["t"]))
        self.verdict = Failure(
            FailureCause.HANG,
            f"no step progress for {seen['stale_s']:.1f}s (faults.hang_timeout_s={self.timeout_s:g}); "
            f"rank {rank} last at step {beat['step']}",
            rank,
        )
        self.kill_group(beats)


def _kill_group(beats: dict[int, dict[str, Any]]) -> None:
    from petatrain.runtime.cluster import kill_pids

    kill_pids([(b["node_id"], b["pid"]) for b in beats.values()])
