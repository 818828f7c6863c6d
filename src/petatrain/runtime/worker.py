"""What a training rank gets from Ray: who it is (rank, world, node, device), the run hub's channel
(events, heartbeats, checkpoint parts, injected faults) and preemption notices.

This module's `RankEnv` is what train/rank.py's Protocols ask for: `RankEnv.from_ray` builds one
inside a Ray Train worker; `train/loop.py` never imports Ray or this module.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from petatrain.observe.events import CheckpointCommit, Event, FaultInjected
from petatrain.runtime.startup import spares


class PreemptionNotice:
    """Turns SIGTERM into a flag the loop checks at the step boundary.

    Inside a Ray worker the process's own SIGTERM handler is redirected (`_ray.replace_sigterm_exit`);
    elsewhere a plain handler is installed where Python allows one. Checked by
    tests/test_train_faults.py (preempt: zero steps lost).
    """

    def __init__(self) -> None:
        self.received_at: float | None = None
        from petatrain.runtime._ray import replace_sigterm_exit

        if not replace_sigterm_exit(self._on_sigterm):  # outside Ray: a plain handler
            import signal

            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, lambda *_: self._on_sigterm())

    def _on_sigterm(self, *args: Any, **kwargs: Any) -> None:
        if self.received_at is None:
            self.received_at = time.time()

    @property
    def received(self) -> bool:
        return self.received_at is not None

    def wait(self, timeout_s: float) -> bool:
        """Until the handler has run (an injected notice: Python runs it on the main thread, which
        may get the GIL only after this thread's next step has read the flag); True if it has."""
        deadline = time.monotonic() + timeout_s
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.received


class Telemetry:
    """Events and heartbeats sent to the run hub at most every `period_s`.

    Rank 0 sends the step events, every rank its heartbeat, once a second. Events keep the
    time they happened and reach the ledger in the order they were recorded (one channel
    per rank: the checkpoint writer's commit events go through it too, after the snapshot
    event). `flush()` is forced before anything that must be in the ledger at once (an
    injected fault, the end of the loop, a commit: rank 0 may be killed right after it when
    another rank failed, `CommitDrain`). The heartbeat
    says how long ago the last step ended, so the watchdog measures a hang from the last
    step, not from the last message.
    """

    def __init__(self, hub: Any, attempt: int, rank: int, node_id: str, period_s: float = 1.0):
        self.hub, self.attempt, self.rank, self.node_id, self.period_s = hub, attempt, rank, node_id, period_s
        self.pending: list[Event] = []
        self.step = -1
        self.step_at = time.time()
        self.sent_at = 0.0
        self._lock = threading.Lock()  # the checkpoint writer's thread records too
        self._answers: list[Any] = []  # the hub's answers to the flushes, not yet read
        self._resize: int | None = None
        self._stop = False  # the driver asked the run to end (stop_requested)

    def record(self, event: Event) -> None:
        """Sent with the next flush; it keeps the time it was made."""
        with self._lock:
            self.pending.append(event)

    def progress(self, step: int, *, now: bool = False) -> None:
        """Step `step` ended; sent with the next flush (at once if `now`)."""
        self.step, self.step_at = step, time.time()
        if now or time.monotonic() - self.sent_at >= self.period_s:
            self.flush()

    def commit(self, info: dict[str, Any]) -> None:
        """The checkpoint writer committed (after its snapshot event if asynchronous); sent at once."""
        self.record(CheckpointCommit(attempt=self.attempt, **info))
        self.flush()

    def alive(self) -> None:
        """The loop is waiting on this rank's checkpoint write: progress for the watchdog, not a step."""
        self.step_at = time.time()
        self.flush()

    def flush(self, wait: bool = False) -> None:
        """Send what is pending; with `wait`, return once the hub has it (before the process may end).
        Any thread may call it: batches leave in the order they were taken."""
        with self._lock:
            events, self.pending = self.pending, []
            age = time.time() - self.step_at if self.step >= 0 else 0.0
            ref = self.hub.telemetry.remote(events, self.attempt, self.rank, self.step, os.getpid(), self.node_id, age)
            self.sent_at = time.monotonic()
            if self.rank == 0:  # the rank that reads them (resize_requested, stop_requested)
                self._answers.append(ref)
        if wait:
            import ray

            ray.get(ref)

    def hold(self, step: int) -> None:
        """Return once the hub released the evaluation of `step` (a search took it)."""
        import ray

        ray.get(self.hub.hold.remote(self.attempt, step))

    def resize_requested(self) -> int | None:
        """The worker count the driver asked for, from the hub's answers to the flushes so far (never waits)."""
        self._read_answers()
        return self._resize

    def stop_requested(self) -> bool:
        """Whether the driver asked the run to end (TrainJob.stop), from the hub's answers so far (never waits)."""
        self._read_answers()
        return self._stop

    def _read_answers(self) -> None:
        import ray

        with self._lock:
            answers = self._answers
        if answers and (self._resize is None or not self._stop):
            ready, _ = ray.wait(answers, num_returns=len(answers), timeout=0)
            with self._lock:
                self._answers = [a for a in self._answers if a not in ready]
            for ref in ready:
                try:
                    asked = ray.get(ref)
                except Exception:  # a hub that failed to answer: its watchdog call fails the attempt too
                    continue
                self._resize = asked.resize if asked.resize is not None else self._resize
                self._stop = self._stop or asked.stop


@dataclass(slots=True)
class HubChannel:
    """One rank's calls to the run hub (an actor), each tagged with the attempt."""

    hub: Any  # RunHub actor handle
    attempt: int
    rank: int
    node_id: str

    def emit(self, event: Event, sync: bool = False) -> None:
        ref = self.hub.emit.remote(event)
        if sync:
            import ray

            ray.get(ref)

    def beat(self, step: int) -> None:
        self.hub.beat.remote(self.attempt, self.rank, step, os.getpid(), self.node_id)

    def telemetry(self, period_s: float = 1.0) -> Telemetry:
        return Telemetry(self.hub, self.attempt, self.rank, self.node_id, period_s=period_s)

    def report_part(self, step: int, rank: int, files: Any) -> Any:
        import ray

        return ray.get(self.hub.report_part.remote(self.attempt, step, rank, files))

    def wait_parts(self, step: int, world: int, timeout_s: float) -> Any:
        import ray

        return ray.get(self.hub.wait_parts.remote(self.attempt, step, world, timeout_s))

    def fired_keys(self) -> set[str]:
        """Injections an earlier attempt (or this one) fired already."""
        import ray

        return set(ray.get(self.hub.fired_keys.remote()))

    def fire(self, key: str, fields: dict[str, Any]) -> bool:
        """Claim injection `key` (each fires once per run); False if another attempt fired it."""
        import ray

        return bool(ray.get(self.hub.fire.remote(key, FaultInjected(attempt=self.attempt, **fields))))


@dataclass(slots=True)
class RankEnv:
    """Who this rank is and its channels to the driver: all the worker loop gets from Ray."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node_id: str
    hub: HubChannel
    accelerator: Callable[[], Any] | None = None  # the device Ray Train assigned this rank (torch.device)
    placement_group: str = ""  # the id of the attempt's placement group the rank runs in ("" if none)

    @classmethod
    def from_ray(cls, hub: Any, attempt: int) -> RankEnv:
        """Inside a Ray Train worker: its context and this node."""
        import ray
        import ray.train

        ctx = ray.train.get_context()
        rank = ctx.get_world_rank()
        node_id = ray.get_runtime_context().get_node_id()
        return cls(
            rank=rank,
            world=ctx.get_world_size(),
            local_rank=ctx.get_local_rank(),
            local_world=ctx.get_local_world_size(),
            node_id=node_id,
            hub=HubChannel(hub, attempt, rank, node_id),
            accelerator=_ray_train_device,
            placement_group=_placement_group_id(),
        )

    def device(self, accelerator: str) -> Any:
        """The torch device for `resources.accelerator`: the CPU, or the one Ray Train assigned."""
        import torch

        if accelerator == "cpu" or self.accelerator is None:
            return torch.device("cpu")
        return self.accelerator()

    def next_ranks(self, cfg: Any) -> spares.Spares:
        """This rank is no longer a spare; once it trains, the node gets spares for the next attempt."""
        return spares.Spares(self.local_rank, self.local_world, enabled=spares.wanted(cfg))

    @staticmethod
    def warm_up() -> dict | None:
        """This process's spare warm-up, None if the rank started in a fresh process."""
        return spares.warmed()

    @staticmethod
    def preemption_notice() -> PreemptionNotice:
        return PreemptionNotice()


def _ray_train_device() -> Any:
    import ray.train.torch

    return ray.train.torch.get_device()


def _placement_group_id() -> str:
    """The attempt's placement group: recorded so that a driver that outlives it (the next driver
    of the run, a search that stopped the trial) can remove it if the driver that made it died."""
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    return group.id.hex() if group is not None else ""
