"""The supervisor's decisions, driven with fakes and queued attempt outcomes: no cluster, no Ray."""

from __future__ import annotations

import pickle

import pytest

from petatrain import config
from petatrain.errors import ConfigError, PetatrainError
from petatrain.runtime.failures import (
    AttemptFailed,
    Failure,
    FailureCause,
    Preempted,
    RankErrorKind,
    classify,
    rank_error,
)
from petatrain.runtime.supervisor import (
    AttemptOutcome,
    RestartDecision,
    RestartPolicy,
    State,
    Supervisor,
    WorldSizePolicy,
)


class FakeCluster:
    """CPUs and nodes that the test changes between attempts."""

    def __init__(self, cpus: float = 2, nodes: set[str] | None = None):
        self.cpus, self.nodes = cpus, nodes or {"a", "b"}

    def resources(self) -> tuple[float, float]:
        return self.cpus, 0

    def alive_nodes(self) -> set[str]:
        return set(self.nodes)


class FakeAttempts:
    """Plays queued outcomes, one per attempt; `on_run` may change the cluster as a fault would."""

    def __init__(self, *outcomes: AttemptOutcome, died: int | None = None, on_run=None):
        self.outcomes, self.died, self.on_run = list(outcomes), died, on_run
        self.runs: list[tuple[int, int]] = []
        self.asked_died = 0

    def run(self, attempt: int, world: int) -> AttemptOutcome:
        self.runs.append((attempt, world))
        if self.on_run:
            self.on_run(attempt)
        return self.outcomes.pop(0) if self.outcomes else AttemptOutcome()

    def rank_died(self, error: AttemptFailed) -> int | None:
        self.asked_died += 1
        return self.died


def job(*overrides: str):
    return config.load(None, ["parallel.workers=1-2", "train.global_batch=8", *overrides])


def _fields(event) -> dict:
    """An event's fields as its ledger line holds them, less the time."""
    from petatrain.observe.events import line

    return {k: v for k, v in line(event).items() if k not in ("t", "event", "v")}


def supervise(attempts: FakeAttempts, cluster: FakeCluster | None = None, *overrides: str):
    cfg = job(*overrides)
    events: list[tuple[str, dict]] = []
    slept: list[float] = []
    sup = Supervisor(
        attempts=attempts,
        cluster=cluster or FakeCluster(),
        restart=RestartPolicy(cfg.faults.max_restarts),
        world_size=WorldSizePolicy(cfg),
        emit=lambda event: events.append((event.kind, _fields(event))),
        sleep=slept.append,
    )
    return sup, events, slept


def raised(rank: int, exc: BaseException) -> AttemptOutcome:
    return AttemptOutcome(error=AttemptFailed([rank_error(rank, exc)]))


def test_a_fault_in_the_first_attempt_is_retried_and_the_second_succeeds():
    attempts = FakeAttempts(raised(1, RuntimeError("injected fault")))
    sup, events, _ = supervise(attempts)
    failures = sup.run()
    assert [f.cause for f in failures] == [FailureCause.EXCEPTION] and failures[0].rank == 1
    assert attempts.runs == [(0, 2), (1, 2)] and sup.state is State.FINISHED
    assert [e for e, _ in events] == ["failure", "restart"]
    assert events[0][1] == {"attempt": 0, "cause": "exception", "detail": "RuntimeError: injected fault", "rank": 1}
    assert events[1][1]["attempt"] == 1 and events[1][1]["reason"] == "exception"


def test_a_hang_is_the_watchdogs_verdict_whatever_the_ranks_raised():
    hang = Failure(FailureCause.HANG, "no step progress for 3.0s", 0)
    killed = AttemptFailed([rank_error(0, RuntimeError("Connection reset by peer"), RankErrorKind.DIED)])
    attempts = FakeAttempts(AttemptOutcome(error=killed, hang=hang))
    sup, events, _ = supervise(attempts)
    assert [f.cause for f in sup.run()] == [FailureCause.HANG]
    assert events[0][1]["cause"] == "hang" and attempts.asked_died == 0


def test_a_lost_node_restarts_on_the_workers_that_are_left():
    cluster = FakeCluster(cpus=2, nodes={"a", "b"})

    def lose_a_node(attempt: int) -> None:
        if attempt == 0:
            cluster.cpus, cluster.nodes = 1, {"a"}

    attempts = FakeAttempts(raised(0, RuntimeError("Connection closed by peer")), on_run=lose_a_node)
    sup, _, slept = supervise(attempts, cluster)
    assert [f.cause for f in sup.run()] == [FailureCause.NODE_LOST]
    assert attempts.runs == [(0, 2), (1, 1)], "the second attempt runs on the one worker the cluster still hosts"
    assert slept == [1.0], "the cluster's view of resources settles first"


def test_the_restart_budget_runs_out():
    attempts = FakeAttempts(*[raised(0, RuntimeError(f"boom {i}")) for i in range(3)])
    sup, events, _ = supervise(attempts, None, "faults.max_restarts=2")
    gave_up = r"training failed 3 times \(faults\.max_restarts=2\); last cause: exception"
    with pytest.raises(PetatrainError, match=gave_up):
        sup.run()
    assert len(attempts.runs) == 3 and sup.state is State.RECOVERING
    assert events[-1] == (
        "end",
        {"status": "failed", "step": None, "detail": "gave up after 2 restarts", "final": None},
    )


def test_a_petatrain_error_on_a_rank_is_reported_not_retried():
    attempts = FakeAttempts(raised(0, ConfigError("model.seq_len 64 needs rows of >= 65 tokens")))
    sup, events, _ = supervise(attempts)
    with pytest.raises(PetatrainError, match=r"^model\.seq_len 64 needs rows of >= 65 tokens$"):
        sup.run()
    assert attempts.runs == [(0, 2)]
    assert [e for e, _ in events] == ["failure", "end"] and events[0][1]["cause"] == "error"


def test_preemptions_do_not_use_up_the_budget():
    attempts = FakeAttempts(*[raised(r, Preempted("preemption notice")) for r in (0, 1, 0)])
    sup, _, _ = supervise(attempts, None, "faults.max_restarts=0")
    assert [f.cause for f in sup.run()] == [FailureCause.PREEMPT] * 3
    assert len(attempts.runs) == 4 and sup.restart.used == 0


def test_a_kill_hidden_behind_a_survivors_collective_error_is_asked_about():
    """Only a lost peer makes the supervisor ask which rank died; the answer turns it into a kill."""
    lost_peer = raised(0, RuntimeError("[gloo] Read error: Connection reset by peer"))
    attempts = FakeAttempts(lost_peer, died=1)
    sup, _, _ = supervise(attempts)
    failures = sup.run()
    assert (failures[0].cause, failures[0].rank) == (FailureCause.KILL, 1) and attempts.asked_died == 1
    plain = FakeAttempts(raised(1, RuntimeError("injected")), died=0)
    sup, _, _ = supervise(plain)
    assert sup.run()[0].cause is FailureCause.EXCEPTION and plain.asked_died == 0, "an exception is not a kill"


def test_restart_policy_returns_typed_decisions():
    policy = RestartPolicy(max_restarts=1)
    exception = Failure(FailureCause.EXCEPTION, "x")
    assert policy.decide(Failure(FailureCause.PREEMPT, "p")) is RestartDecision.RETRY
    assert policy.decide(Failure(FailureCause.RESIZE, "r")) is RestartDecision.RETRY  # neither uses the budget
    assert policy.decide(exception) is RestartDecision.RETRY
    assert policy.decide(exception) is RestartDecision.RAISE
    assert RestartPolicy(5).decide(Failure(FailureCause.ERROR, "e")) is RestartDecision.RAISE


def test_rank_errors_keep_their_cause_across_processes():
    """What crosses from Ray's processes is plain data: the cause survives pickling."""
    error = AttemptFailed(
        [rank_error(0, Preempted("notice")), rank_error(1, OSError("gone"), RankErrorKind.DIED)], "text"
    )
    back = pickle.loads(pickle.dumps(error))
    assert back.errors == error.errors and str(back) == "text"
    assert back.errors[0].cause is FailureCause.PREEMPT and back.errors[1].cause is None
    assert classify(back, hang=None, nodes_lost=False).cause is FailureCause.PREEMPT
    died = AttemptFailed([rank_error(1, OSError("gone"), RankErrorKind.DIED)])
    assert (classify(died, hang=None, nodes_lost=False).cause, classify(died, hang=None, nodes_lost=False).rank) == (
        FailureCause.KILL,
        1,
    )


def test_world_size_is_the_largest_that_fits_and_divides_the_batch():
    policy = WorldSizePolicy(job("parallel.workers=1-4", "train.global_batch=6", "train.micro_batch=1"))
    assert policy.choose(cpus=4, gpus=0) == 3
    assert policy.choose(cpus=1, gpus=0) == 1
    with pytest.raises(PetatrainError, match="can host 0 worker"):
        policy.choose(cpus=0, gpus=0)
    # growing back: only to a count that fits, divides the batch and is more than the attempt's
    assert policy.larger(1, cpus=4, gpus=0) == 3
    assert policy.larger(3, cpus=8, gpus=0) is None and policy.larger(1, cpus=1, gpus=0) is None
    assert policy.larger(1, cpus=0, gpus=0) is None  # the cluster is going away: no resize
    fixed = WorldSizePolicy(job("parallel.workers=2"))
    assert fixed.larger(2, cpus=16, gpus=0) is None
    pipeline = WorldSizePolicy(
        job("parallel.strategy=pipeline", "parallel.workers=2-4", "train.global_batch=8", "train.micro_batch=1")
    )
    assert pipeline.larger(2, cpus=3, gpus=0) is None and pipeline.larger(2, cpus=4, gpus=0) == 4  # stages x replicas
    # Tensor-parallel groups stay whole: a lost node shrinks the replicas, and they grow back, by whole groups.
    tensor = WorldSizePolicy(
        job("parallel.tensor=2", "parallel.workers=2-6", "train.global_batch=12", "train.micro_batch=1")
    )
    assert tensor.choose(cpus=5, gpus=0) == 4 and tensor.choose(cpus=3, gpus=0) == 2
    assert tensor.larger(2, cpus=5, gpus=0) == 4 and tensor.larger(4, cpus=6, gpus=0) == 6
    assert tensor.larger(4, cpus=5, gpus=0) is None


def test_a_resize_is_its_own_cause():
    from petatrain.train.rank import Resized

    error = AttemptFailed([rank_error(0, Resized("more workers")), rank_error(1, OSError("reset"))], "text")
    assert classify(error, hang=None, nodes_lost=False).cause is FailureCause.RESIZE


def test_a_hub_that_stops_answering_is_logged_once_not_swallowed(caplog):
    """The watchdog's hub calls failing would silently turn hang detection off: it says so, once per outage."""
    import logging
    import time

    from petatrain.runtime.watchdog import Watchdog

    class DeadHub:
        class watch:  # stands in for the actor method
            @staticmethod
            def remote(*args):
                raise ConnectionError("the run hub's actor died")

    caplog.set_level(logging.DEBUG, logger="petatrain.runtime.watchdog")
    watch = Watchdog(DeadHub, timeout_s=1.0)
    watch.RETRY_S = 0.01
    watch.start(0, 2)
    deadline = time.monotonic() + 2
    while watch.failed_calls < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    assert watch.failed_calls >= 3 and watch.verdict is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "hangs go undetected" in warnings[0].getMessage(), warnings
    assert "the run hub's actor died" in warnings[0].getMessage()


def test_an_attempt_that_could_grow_is_asked_about_every_few_seconds_until_it_resizes(monkeypatch):
    """An elastic run below its top worker count: the hub answers the watchdog every GROW_POLL_S (not
    WAIT_S), so a node that joins is used within seconds; once the resize is asked, or at the top of the
    range, the long wait."""
    import time

    import ray

    from petatrain.runtime.watchdog import Watchdog

    waits: list[float] = []
    resized: list[tuple[int, int]] = []
    room = iter([None, None, 4])  # the cluster grows back at the third look

    class Hub:
        class watch:
            @staticmethod
            def remote(attempt, timeout_s, announced, wait_s):
                waits.append(wait_s)
                return {"beats": {0: {"step": 3, "t": 0.0}}, "stepped": True, "stale_s": None}

        class request_resize:
            @staticmethod
            def remote(attempt, world):
                resized.append((attempt, world))

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)  # the fake hub answers at once
    watch = Watchdog(Hub, timeout_s=1.0, grow=lambda world: next(room, None))
    watch.start(0, 2)
    deadline = time.monotonic() + 5
    while len(waits) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    assert resized == [(0, 4)], resized
    grow_polls = waits[: waits.index(Watchdog.WAIT_S)]
    assert len(grow_polls) == 3 and set(grow_polls) == {Watchdog.GROW_POLL_S}, waits
    assert Watchdog.GROW_POLL_S < Watchdog.WAIT_S and set(waits[3:]) == {Watchdog.WAIT_S}, waits

    # At the top of parallel.workers already (a run of a fixed size is always there): the long wait
    # from the start, and the cluster is not asked.
    waits.clear()
    asked: list[int] = []
    full = Watchdog(Hub, timeout_s=1.0, grow=lambda world: asked.append(world), most=4)
    full.start(0, 4)
    deadline = time.monotonic() + 5
    while len(waits) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    full.stop()
    assert waits and set(waits) == {Watchdog.WAIT_S} and asked == [], (waits, asked)


def test_run_result_is_typed_and_still_reads_as_the_old_summary():
    from petatrain.runtime.driver import RunResult

    result = RunResult(
        run="/r", final="/r/final/model.safetensors", steps=40, attempts=2,
        failures=[Failure(FailureCause.KILL, "worker process died", 1)], wall_s=12.5,
    )  # fmt: skip
    assert result.failures[0].cause is FailureCause.KILL
    summary = result.to_dict()
    assert summary == {
        "run": "/r",
        "final": "/r/final/model.safetensors",
        "steps": 40,
        "attempts": 2,
        "failures": [{"cause": "kill", "detail": "worker process died", "rank": 1}],
        "wall_s": 12.5,
    }
    assert result["failures"] == summary["failures"] and result["steps"] == 40


def test_a_cluster_too_small_is_waited_for_then_refused():
    """After a lost pod the cluster has no room until its replacement joins: the supervisor waits
    (faults.capacity_wait_s, polling), then schedules; a cluster that never grows fails naming the wait."""
    from petatrain.runtime import supervisor as sup

    class Growing:
        def __init__(self, cpus: list[float]):
            self.cpus = cpus

        def resources(self):
            return (self.cpus.pop(0) if len(self.cpus) > 1 else self.cpus[0]), 0.0

    slept: list[float] = []
    machine = sup.Supervisor(
        attempts=None, cluster=Growing([0, 0, 2]), restart=sup.RestartPolicy(3),
        world_size=WorldSizePolicy(job("parallel.workers=2")), emit=lambda *a, **k: None,
        sleep=slept.append, capacity_wait_s=10,
    )  # fmt: skip
    assert machine._room() == 2 and slept == [sup.CAPACITY_POLL_S] * 2
    never = sup.Supervisor(
        attempts=None, cluster=Growing([0]), restart=sup.RestartPolicy(3),
        world_size=WorldSizePolicy(job("parallel.workers=2")), emit=lambda *a, **k: None,
        sleep=lambda s: None, capacity_wait_s=5,
    )  # fmt: skip
    with pytest.raises(PetatrainError, match=r"can host 0 worker.*after waiting 6 s, faults.capacity_wait_s"):
        never._room()
