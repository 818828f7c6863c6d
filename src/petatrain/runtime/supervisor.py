"""The supervisor: attempts until the run ends, as an explicit state machine (as Ray Train v2's controller).

    SCHEDULING --world size chosen--> RUNNING --attempt ok--> FINISHED
        ^                                |
        |                             failed
        |                                v
        +-------- RETRY ------------ RECOVERING --RAISE--> (PetatrainError)

What it talks to is injected: `Attempts` runs one attempt on N workers and answers about it,
`Cluster` says what is alive, `RestartPolicy` and `WorldSizePolicy` return typed decisions.
So the logic runs with fakes in tests (tests/test_supervisor.py), no cluster needed.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from petatrain.config import JobConfig
from petatrain.errors import PetatrainError
from petatrain.observe import events as ev
from petatrain.runtime.failures import AttemptFailed, Failure, FailureCause, classify, lost_a_peer

log = logging.getLogger(__name__)

NODE_LOST_SETTLE_S = 1.0  # after a lost node: let the cluster's view of resources settle
CAPACITY_POLL_S = 2.0  # how often a cluster too small for the next attempt is asked again


class State(enum.Enum):
    SCHEDULING = "scheduling"  # choosing the next attempt's world size
    RUNNING = "running"  # an attempt trains
    RECOVERING = "recovering"  # an attempt failed: classify, record, decide
    FINISHED = "finished"


class RestartDecision(enum.Enum):
    RETRY = "retry"  # resume from the newest verified checkpoint
    RAISE = "raise"  # give up: the run fails


class RestartPolicy:
    """Retry up to `max_restarts` failures; preemptions and resizes do not use up the budget, petatrain
    errors are not retried."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.used = 0

    def decide(self, failure: Failure) -> RestartDecision:
        if failure.cause in (FailureCause.PREEMPT, FailureCause.RESIZE):
            return RestartDecision.RETRY
        if failure.cause is FailureCause.ERROR:
            return RestartDecision.RAISE
        self.used += 1
        return RestartDecision.RETRY if self.used <= self.max_restarts else RestartDecision.RAISE

    def gave_up(self, failure: Failure) -> PetatrainError:
        """The error a RAISE ends the run with."""
        if failure.cause is FailureCause.ERROR:
            return PetatrainError(failure.detail.split(": ", 1)[-1])
        return PetatrainError(
            f"training failed {self.used} times (faults.max_restarts={self.max_restarts}); "
            f"last cause: {failure.cause.value}: {failure.detail}"
        )

    def why(self, failure: Failure) -> str:
        """The ledger's `end` detail for a RAISE."""
        return failure.detail if failure.cause is FailureCause.ERROR else f"gave up after {self.used - 1} restarts"


class TooSmall(PetatrainError):
    """The alive cluster cannot host the smallest worker count the job allows."""


class WorldSizePolicy:
    """The largest worker count in parallel.workers that the alive cluster can host and that divides the
    batch (for a pipeline: a multiple of its stages whose replicas x micro-batches divide it)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    def choose(self, cpus: float, gpus: float) -> int:
        cfg = self.cfg
        lo, hi = cfg.parallel.worker_range()
        per = cfg.resources.cpus_per_worker
        fit = int(cpus // per) if per else hi
        if use_gpu(cfg, gpus):
            fit = min(fit, int(gpus))
        for n in range(min(hi, fit), lo - 1, -1):
            if cfg.parallel.runs_on(n, cfg.train.global_batch):
                return n
        raise TooSmall(
            f"the cluster can host {fit} worker(s) of {per} CPU; parallel.workers={cfg.parallel.workers} "
            f"and train.global_batch={cfg.train.global_batch} need at least {lo} (and a count dividing the batch)"
        )

    def larger(self, world: int, cpus: float, gpus: float) -> int | None:
        """The worker count to grow to, when the alive cluster can host more than `world` (else None)."""
        if self.cfg.parallel.worker_range()[1] <= world:
            return None
        try:
            n = self.choose(cpus, gpus)
        except PetatrainError:
            return None
        return n if n > world else None


def use_gpu(cfg: JobConfig, gpus: float) -> bool:
    return cfg.resources.accelerator == "gpu" or (cfg.resources.accelerator == "auto" and gpus >= 1)


@dataclass(slots=True)
class AttemptOutcome:
    """How an attempt ended: `error` None if it trained to the end; `hang` the watchdog's verdict."""

    error: AttemptFailed | None = None
    hang: Failure | None = None


class Attempts(Protocol):
    def run(self, attempt: int, world: int) -> AttemptOutcome:
        """Run attempt `attempt` on `world` workers to its end."""

    def rank_died(self, error: AttemptFailed) -> int | None:
        """The rank whose process died on its own, when the error names only survivors (else None)."""


class Cluster(Protocol):
    def resources(self) -> tuple[float, float]:
        """Alive CPUs and GPUs."""

    def alive_nodes(self) -> set[str]: ...


@dataclass(slots=True)
class Supervisor:
    """Runs attempts until one trains to the end or the restart policy gives up."""

    attempts: Attempts
    cluster: Cluster
    restart: RestartPolicy
    world_size: WorldSizePolicy
    emit: Callable[[ev.Event], Any]  # the ledger
    before_attempt: Callable[[], None] = lambda: None  # e.g. the run directory's lease is still ours
    # On a cluster that can grow (KubeRay replacing a lost pod, the autoscaler adding nodes): how
    # long to wait for room for the smallest worker count before giving up; 0 on a local Ray.
    capacity_wait_s: float = 0.0
    sleep: Callable[[float], None] = time.sleep
    state: State = State.SCHEDULING
    attempt: int = 0
    world: int = 0
    failures: list[Failure] = field(default_factory=list)

    def run(self) -> list[Failure]:
        """Until FINISHED (returns the failures recovered from), or a RAISE (raises PetatrainError)."""
        nodes_before: set[str] = set()
        outcome = AttemptOutcome()
        while self.state is not State.FINISHED:
            if self.state is State.SCHEDULING:
                # Totals of the alive nodes: the failed attempt's workers are still being released.
                self.world = self._room()
                nodes_before = self.cluster.alive_nodes()
                self.before_attempt()
                self.state = State.RUNNING
            elif self.state is State.RUNNING:
                outcome = self.attempts.run(self.attempt, self.world)
                self.state = State.FINISHED if outcome.error is None else State.RECOVERING
            elif self.state is State.RECOVERING:
                assert outcome.error is not None
                self._recover(self._classify(outcome, nodes_before))
                self.state = State.SCHEDULING
        return self.failures

    def _room(self) -> int:
        """The next attempt's worker count, once the cluster can host the smallest one (or TooSmall)."""
        waited, told = 0.0, False
        while True:
            try:
                return self.world_size.choose(*self.cluster.resources())
            except TooSmall as small:
                if waited >= self.capacity_wait_s:
                    if told:
                        raise TooSmall(f"{small} (after waiting {waited:.0f} s, faults.capacity_wait_s)") from None
                    raise
                if not told:
                    log.warning("%s; waiting up to %.0f s for the cluster to grow", small, self.capacity_wait_s)
                    told = True
                self.sleep(CAPACITY_POLL_S)
                waited += CAPACITY_POLL_S

    def _classify(self, outcome: AttemptOutcome, nodes_before: set[str]) -> Failure:
        error = outcome.error
        assert error is not None
        lost = bool(nodes_before - self.cluster.alive_nodes())  # Ray marks a node dead before the failed health check
        failure = classify(error, hang=outcome.hang, nodes_lost=lost)
        if failure.cause in (FailureCause.EXCEPTION, FailureCause.UNKNOWN) and lost_a_peer(error):
            died = self.attempts.rank_died(error)  # a rank died, and a survivor's error came first
            if died is not None:
                failure = classify(error, hang=None, nodes_lost=False, died=died)
        return failure

    def _recover(self, failure: Failure) -> None:
        self.failures.append(failure)
        cause = failure.cause.value
        self.emit(ev.Failure(attempt=self.attempt, cause=cause, detail=failure.detail, rank=failure.rank))
        if self.restart.decide(failure) is RestartDecision.RAISE:
            self.emit(ev.End(status="failed", step=None, detail=self.restart.why(failure)))
            raise self.restart.gave_up(failure)
        self.attempt += 1
        if failure.cause is FailureCause.NODE_LOST:
            self.sleep(NODE_LOST_SETTLE_S)
        self.emit(ev.Restart(attempt=self.attempt, world_size=None, reason=failure.cause.value))
