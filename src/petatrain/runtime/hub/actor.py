"""`RunHub`, the run hub's Ray actor: each method hands its call to one of the plain classes of
this package (see its docstring); here are only the threads each call runs on."""

from __future__ import annotations

import threading
from typing import Any

import ray

from petatrain.observe.events import Event, FaultInjected
from petatrain.observe.ledger import EventLog
from petatrain.runtime.hub.attempt import Asked, Attempt, Drain, Heartbeats, Resizes
from petatrain.runtime.hub.injections import FiredInjections
from petatrain.runtime.hub.ledger import Ledger, StepHold
from petatrain.runtime.hub.metrics import Metrics
from petatrain.runtime.hub.parts import PartsRendezvous
from petatrain.runtime.hub.phase import PlacementGroups, RunPhase
from petatrain.runtime.hub.watch import EvalHold, HangWatch
from petatrain.storage import StorageOptions


@ray.remote(num_cpus=0, concurrency_groups={"ledger": 1, "parts": 16, "watch": 2, "linger": 1})
class RunHub:
    """Ledger writes run on one thread ("ledger") so events land in the order they were sent;
    checkpoint-part waits, the watchdog's long poll and the wait for the metrics' last scrape block
    threads of their own ("parts", "watch", "linger"); the rest answer on the default thread.

    `fired`: injected faults an earlier driver's attempts fired (in the ledger). `hold_until_a_step`:
    the run ended ok and this driver continues it; its events wait until it trains a step.
    """

    def __init__(
        self,
        run_url: str,
        options: StorageOptions | None,
        metrics_host: str = "",
        metrics_port: int = 0,
        fired: list[str] | None = None,
        hold_until_a_step: bool = False,
    ):
        log = EventLog(run_url, options)
        self.metrics = Metrics.serve(metrics_host, metrics_port)
        self.phase, self.groups = RunPhase(), PlacementGroups()
        self.ledger = Ledger(
            log, StepHold(hold_until_a_step), (self.phase.track, self.groups.track, self.metrics.observe)
        )
        self.attempt = Attempt()
        self.beats, self.drain, self.resizes = Heartbeats(self.attempt), Drain(self.attempt), Resizes()
        self.stopping = threading.Event()  # the driver asked the run to end (request_stop)
        self.evals = EvalHold(self.attempt, self.beats)
        self.hang = HangWatch(self.attempt, self.beats, self.drain, self.evals)
        self.parts = PartsRendezvous(self.attempt, self.drain)
        self.injections = FiredInjections(fired or ())

    # -- ledger -------------------------------------------------------------------------------
    @ray.method(concurrency_group="ledger")
    def emit(self, event: Event) -> dict[str, Any]:
        return self.ledger.emit(event)

    @ray.method(concurrency_group="ledger")
    def emit_many(self, batch: list[Event]) -> None:
        """Several events in one call, in order."""
        self.ledger.emit_many(batch)

    @ray.method(concurrency_group="ledger")
    def telemetry(
        self,
        batch: list[Event],
        attempt: int,
        rank: int,
        step: int,
        pid: int,
        node_id: str,
        age_s: float = 0.0,
    ) -> Asked:
        """A rank's batched events and its heartbeat: one actor call per flush of the loop. Returns
        what the driver asked: the worker count to restart this attempt on (`request_resize`), and
        whether the run is to end (`request_stop`)."""
        self.ledger.emit_many(batch)
        self.beats.beat(attempt, rank, step, pid, node_id, age_s)
        return Asked(self.resizes.asked(attempt), self.stopping.is_set())

    @ray.method(concurrency_group="ledger")
    def started(self) -> bool:
        """Whether the run's record is being written (not held: see `hold_until_a_step`)."""
        return self.ledger.started

    @ray.method(concurrency_group="ledger")
    def flush(self) -> None:
        self.ledger.flush()

    @ray.method(concurrency_group="ledger")
    def close(self) -> None:
        self.ledger.close()
        self.metrics.close()

    # -- what the events say: health, placement groups, metrics ---------------------------------
    def health(self) -> dict[str, Any]:
        """The run's state for the driver's health endpoint: state, attempt, newest step and when."""
        return self.phase.health(self.attempt.number, self.beats.last_step_t())

    def placement_groups(self) -> list[str]:
        return self.groups.ids()

    def metrics_url(self) -> str | None:
        return self.metrics.url(ray.util.get_node_ip_address)

    @ray.method(concurrency_group="linger")
    def last_scrape(self, max_s: float) -> bool:
        return self.metrics.last_scrape(max_s)

    # -- attempts, heartbeats, hangs ------------------------------------------------------------
    def new_attempt(self, attempt: int) -> None:
        self.attempt.start(attempt)

    def beat(self, attempt: int, rank: int, step: int, pid: int, node_id: str, age_s: float = 0.0) -> None:
        self.beats.beat(attempt, rank, step, pid, node_id, age_s)

    def heartbeats(self) -> dict[int, dict[str, Any]]:
        return self.beats.snapshot()

    def attempt_failed(self, attempt: int, lost: list[int]) -> None:
        """The attempt is ending on a failure and the ranks in `lost` are gone (`Drain`)."""
        self.drain.attempt_failed(attempt, lost)

    def request_resize(self, attempt: int, world: int) -> None:
        """The cluster can host `world` workers now: the attempt's rank 0 hears it in its next
        telemetry answer and the ranks stop together after a checkpoint (`train.rank.Resized`)."""
        self.resizes.request(attempt, world)

    def request_stop(self) -> None:
        """End the run: the attempt's rank 0 hears it in its next telemetry answer, and the ranks stop
        together at the next step boundary, checkpointed, with the final weights (`TrainJob.stop`)."""
        self.stopping.set()

    @ray.method(concurrency_group="watch")
    def watch(self, attempt: int, timeout_s: float, announced: bool, wait_s: float) -> dict[str, Any]:
        """The driver's watchdog's long poll (`HangWatch`)."""
        return self.hang.watch(attempt, timeout_s, announced, wait_s)

    # -- holds at evaluations -------------------------------------------------------------------
    @ray.method(concurrency_group="parts")
    def hold(self, attempt: int, step: int) -> None:
        """Rank 0 waits here after the evaluation of `step` until `release(step)`: no hang meanwhile."""
        self.evals.hold(attempt, step)

    def release(self, step: int) -> None:
        self.evals.release(step)

    # -- checkpoint parts -----------------------------------------------------------------------
    @ray.method(concurrency_group="parts")
    def report_part(self, attempt: int, step: int, rank: int, files: dict | None) -> None:
        self.parts.report(attempt, step, rank, files)

    @ray.method(concurrency_group="parts")
    def wait_parts(self, attempt: int, step: int, world_size: int, timeout_s: float) -> dict | None:
        return self.parts.wait(attempt, step, world_size, timeout_s)

    # -- fault injection ------------------------------------------------------------------------
    @ray.method(concurrency_group="ledger")
    def fire(self, key: str, event: FaultInjected) -> bool:
        """True the first time `key` fires; its event is written before the fault acts."""
        if not self.injections.claim(key):
            return False
        self.ledger.write_at_once(event)
        return True

    def fired_keys(self) -> list[str]:
        return self.injections.keys()
