"""The run hub's parts (petatrain.runtime.hub), each driven with a fake clock and ledger: no Ray.

The actor (`hub/actor.py`) only hands calls to these classes; tests/test_runtime.py drives it on Ray.
"""

from __future__ import annotations

import ast
import re
import threading
import time
from pathlib import Path
from typing import Any

from petatrain.observe import events as ev
from petatrain.runtime.hub.attempt import Attempt, Drain, Heartbeats, Resizes
from petatrain.runtime.hub.injections import FiredInjections
from petatrain.runtime.hub.ledger import Ledger, StepHold
from petatrain.runtime.hub.metrics import Metrics
from petatrain.runtime.hub.parts import PartsRendezvous
from petatrain.runtime.hub.phase import PlacementGroups, RunPhase
from petatrain.runtime.hub.watch import EvalHold, HangWatch

SRC = Path(__file__).resolve().parents[1] / "src" / "petatrain"
HUB = SRC / "runtime" / "hub"


class Clock:
    """A clock the test sets."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


ATTEMPT = {"attempt": 0, "world_size": 1}
CONTINUE = {"run_id": "r", "attempt": 1, "previous": "ok", "steps": 9}


def step(n: int) -> dict[str, Any]:
    """A step event's fields."""
    return {"attempt": 0, "step": n, "step_s": 0.1, "data_wait_s": 0.0, "loss": 1.0}


class FakeLog:
    """The ledger's sink (observe.ledger.EventLog): what was written, and when it was flushed."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.flushes = 0
        self.closed = False

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        self.lines.append(record["event"])
        return record

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def _board(clock: Clock | None = None) -> tuple[Attempt, Heartbeats, Drain, EvalHold, HangWatch]:
    attempt = Attempt(clock or Clock())
    beats, drain = Heartbeats(attempt), Drain(attempt)
    hold = EvalHold(attempt, beats)
    return attempt, beats, drain, hold, HangWatch(attempt, beats, drain, hold)


def _in_thread(target, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(target(*args)), daemon=True)
    thread.start()
    return thread, out


# -- attempts, heartbeats, drain, resizes ----------------------------------------------------------
def test_a_new_attempt_resets_what_belonged_to_the_last_and_wakes_waiters():
    attempt = Attempt(Clock())
    resets: list[tuple[str, int]] = []
    attempt.on_new(lambda n: resets.append(("first", n)))
    attempt.on_new(lambda n: resets.append(("second", n)))
    woken = threading.Event()

    def wait() -> None:
        with attempt.cond:
            attempt.cond.wait_for(lambda: attempt.number == 3, timeout=2)
            woken.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.01)
    attempt.start(3)
    thread.join(1)
    assert attempt.number == 3 and resets == [("first", 3), ("second", 3)] and woken.is_set()


def test_heartbeats_are_dated_by_their_age_on_the_hubs_clock_for_the_current_attempt_only():
    clock = Clock(1000.0)
    attempt, beats, *_ = _board(clock)
    attempt.start(1)
    beats.beat(1, 0, 5, 11, "node-a", age_s=2.5)
    beats.beat(0, 1, 9, 12, "node-b")  # a beat of the failed attempt, arriving late
    assert beats.snapshot() == {0: {"t": 997.5, "step": 5, "pid": 11, "node_id": "node-a"}}
    beats.snapshot()[0]["step"] = 99  # a copy: the caller cannot change the hub's
    assert beats.snapshot()[0]["step"] == 5
    beats.beat(1, 1, -1, 12, "node-b")  # started, no step yet
    assert beats.last_step_t() == 997.5, "the newest step's time, not a rank's start"
    attempt.start(2)
    assert beats.snapshot() == {} and beats.last_step_t() is None


def test_a_failed_attempts_lost_ranks_drain_until_the_next_attempt():
    attempt, _, drain, *_ = _board()
    attempt.start(4)
    drain.attempt_failed(3, [1])  # an older attempt's: ignored
    assert drain.lost == set() and not drain.draining
    drain.attempt_failed(4, [2, 1])
    assert drain.lost == {1, 2} and drain.draining
    attempt.start(5)
    assert drain.lost == set() and not drain.draining


def test_a_resize_is_asked_of_one_attempt():
    resizes = Resizes()
    resizes.request(2, 4)
    assert resizes.asked(2) == 4 and resizes.asked(3) is None


# -- the watchdog's long poll ----------------------------------------------------------------------
def test_no_beat_yet_is_not_a_hang():
    attempt, _, _, _, hang = _board(Clock(5000.0))
    attempt.start(0)
    assert hang.watch(0, 1.0, True, 0.0) == {"beats": {}, "stepped": False, "stale_s": None}


def test_a_hang_is_due_after_the_timeout_and_three_times_it_before_the_first_step():
    clock = Clock(0.0)
    attempt, beats, _, _, hang = _board(clock)
    attempt.start(0)
    beats.beat(0, 0, -1, 1, "n")  # started at t=0
    clock.t = 2.5
    assert hang.watch(0, 1.0, True, 0.0)["stale_s"] is None, "starting: 3 x the timeout"
    clock.t = 3.5
    assert hang.watch(0, 1.0, True, 0.0)["stale_s"] == 3.5
    beats.beat(0, 0, 4, 1, "n")  # stepped at t=3.5
    clock.t = 4.0
    assert hang.watch(0, 1.0, True, 0.0)["stale_s"] is None
    clock.t = 5.0
    seen = hang.watch(0, 1.0, True, 0.0)
    assert seen["stale_s"] == 1.5 and seen["stepped"] and seen["beats"][0]["step"] == 4


def test_the_first_step_is_answered_at_once_unless_announced():
    clock = Clock(0.0)
    attempt, beats, _, _, hang = _board(clock)
    attempt.start(0)
    beats.beat(0, 0, 0, 1, "n")
    started = time.monotonic()
    assert hang.watch(0, 10.0, False, 5.0)["stepped"], "not announced yet: the driver prepares the next attempt"
    assert time.monotonic() - started < 0.5
    assert hang.watch(0, 10.0, True, 0.0)["stale_s"] is None


def test_a_drain_or_an_evaluation_hold_is_not_a_hang():
    clock = Clock(0.0)
    attempt, beats, drain, hold, hang = _board(clock)
    attempt.start(0)
    beats.beat(0, 0, 7, 1, "n")
    clock.t = 100.0
    drain.attempt_failed(0, [1])
    assert hang.watch(0, 1.0, True, 0.0)["stale_s"] is None, "survivors finish their writes"
    attempt.start(1)
    beats.beat(1, 0, 7, 1, "n")
    clock.t = 200.0
    hold.holding = 7
    assert hang.watch(1, 1.0, True, 0.0)["stale_s"] is None, "rank 0 waits for a search to take its evaluation"


def test_a_waiting_watch_answers_when_a_new_attempt_starts():
    attempt, _, _, _, hang = _board(Clock(0.0))
    attempt.start(0)
    thread, out = _in_thread(hang.watch, 0, 1.0, True, 5.0)  # the fake clock never ends its wait
    time.sleep(0.02)
    attempt.start(1)
    thread.join(1)
    assert out == [{"beats": {}, "stepped": False, "stale_s": None}]


def test_a_beat_moves_the_hang_deadline_of_a_waiting_watch():
    attempt = Attempt()  # the real clock: the watch waits for the deadline
    beats, drain = Heartbeats(attempt), Drain(attempt)
    hang = HangWatch(attempt, beats, drain, EvalHold(attempt, beats))
    attempt.start(0)
    beats.beat(0, 0, 1, 1, "n")
    started = time.monotonic()
    thread, out = _in_thread(hang.watch, 0, 0.15, True, 5.0)
    for step in (2, 3):
        time.sleep(0.08)
        beats.beat(0, 0, step, 1, "n")
    thread.join(2)
    took = time.monotonic() - started
    assert out[0]["stale_s"] >= 0.15 and out[0]["beats"][0]["step"] == 3
    assert 0.3 <= took < 0.8, "answered once the last beat was 0.15 s old"


# -- evaluation holds -------------------------------------------------------------------------------
def test_an_evaluation_is_held_until_released_and_the_hang_clock_starts_again():
    clock = Clock(0.0)
    attempt, beats, _, hold, _ = _board(clock)
    attempt.start(0)
    beats.beat(0, 0, 10, 1, "n")
    thread, out = _in_thread(hold.hold, 0, 10)
    time.sleep(0.02)
    assert thread.is_alive() and hold.holding == 10
    clock.t = 50.0
    hold.release(10)
    thread.join(1)
    assert out == [None] and hold.holding is None and beats.snapshot()[0]["t"] == 50.0
    started = time.monotonic()
    hold.hold(0, 10)  # trained again after a restart: released already
    hold.hold(0, 9)
    assert time.monotonic() - started < 0.1


def test_a_new_attempt_ends_the_hold_of_the_old_one():
    attempt, _, _, hold, _ = _board()
    attempt.start(0)
    thread, out = _in_thread(hold.hold, 0, 20)
    time.sleep(0.02)
    attempt.start(1)
    thread.join(1)
    assert out == [None] and hold.released == -1


# -- checkpoint parts --------------------------------------------------------------------------------
def _parts() -> tuple[Attempt, Drain, PartsRendezvous]:
    attempt = Attempt()
    drain = Drain(attempt)
    attempt.start(0)
    return attempt, drain, PartsRendezvous(attempt, drain)


def test_rank_zero_gets_every_ranks_files_once_all_reported():
    _, _, parts = _parts()
    parts.report(0, 10, 1, {"b": {"size": 2}})
    thread, out = _in_thread(parts.wait, 0, 10, 2, 2.0)
    time.sleep(0.02)
    assert thread.is_alive()
    parts.report(0, 10, 0, {"a": {"size": 1}})
    thread.join(1)
    assert out == [{"b": {"size": 2}, "a": {"size": 1}}]
    assert parts.parts == {}, "taken: a second commit of the step waits again"


def test_a_failed_write_a_lost_rank_or_the_timeout_gives_the_checkpoint_up():
    _, drain, parts = _parts()
    parts.report(0, 10, 1, None)  # rank 1's write failed
    assert parts.wait(0, 10, 2, 2.0) is None and (0, 10) not in parts.parts
    parts.report(0, 20, 0, {"a": {}})
    drain.attempt_failed(0, [1])  # rank 1 is gone before writing its part
    started = time.monotonic()
    assert parts.wait(0, 20, 2, 2.0) is None and time.monotonic() - started < 0.1
    assert parts.wait(0, 30, 1, 0.05) is None, "nobody reported within the timeout"


def test_a_new_attempt_wakes_the_old_waiter_and_forgets_older_parts():
    attempt, _, parts = _parts()
    parts.report(0, 10, 0, {"a": {}})
    thread, out = _in_thread(parts.wait, 0, 10, 2, 5.0)
    time.sleep(0.02)
    parts.report(2, 10, 0, {"later": {}})  # reported early by a later attempt: kept
    attempt.start(1)
    thread.join(1)
    assert out == [None] and set(parts.parts) == {(2, 10)}


# -- the ledger ----------------------------------------------------------------------------------------
def test_step_hold_writes_nothing_until_a_step_then_everything_in_order():
    assert StepHold().admit("run_start", {"n": 1}) == [{"n": 1}] and StepHold().started
    hold = StepHold(holding=True)
    assert not hold.started
    assert hold.admit("run_continue", {"n": 1}) == [] and hold.admit("attempt_start", {"n": 2}) == []
    assert hold.admit("step", {"n": 3}) == [{"n": 1}, {"n": 2}, {"n": 3}] and hold.started
    assert hold.admit("step", {"n": 4}) == [{"n": 4}]


def test_ledger_writes_in_order_shows_every_event_to_its_observers_and_flushes_every_few_seconds():
    log, clock, seen = FakeLog(), Clock(0.0), []
    observers = (lambda e: seen.append(("health", e.kind)), lambda e: seen.append(("m", 0)))
    ledger = Ledger(log, StepHold(), observers, clock)
    record = ledger.emit(ev.RunStart(run_id="r", workers=[1, 1], steps=2, config={}, t=1.0))
    assert record["event"] == "run_start" and record["run_id"] == "r"
    ledger.emit_many([ev.AttemptStart(**ATTEMPT), ev.Step(**step(0))])
    assert log.lines == ["run_start", "attempt_start", "step"] and log.flushes == 0
    assert seen[:2] == [("health", "run_start"), ("m", 0)]
    clock.t = Ledger.FLUSH_S + 0.1
    ledger.emit(ev.Step(**step(1)))
    assert log.flushes == 1 and ledger.last_flush == clock.t
    ledger.close()
    assert log.closed


def test_a_held_ledger_observes_every_event_but_writes_only_once_a_step_came():
    log, seen = FakeLog(), []
    ledger = Ledger(log, StepHold(holding=True), (lambda e: seen.append(e.kind),), Clock())
    ledger.emit(ev.RunContinue(**CONTINUE))
    ledger.emit(ev.AttemptStart(**ATTEMPT))
    assert log.lines == [] and seen == ["run_continue", "attempt_start"] and not ledger.started
    ledger.emit(ev.Step(**step(5)))
    assert log.lines == ["run_continue", "attempt_start", "step"] and ledger.started


def test_an_injected_fault_is_written_and_flushed_at_once_or_held_with_the_rest():
    log, seen = FakeLog(), []
    ledger = Ledger(log, StepHold(), (seen.append,), Clock())
    ledger.write_at_once(ev.FaultInjected(attempt=0, fault="kill", step=3, key="kill@step=3"))
    assert log.lines == ["fault_injected"] and log.flushes == 1 and seen == []
    # A finished run's continuation that has not trained a step: held in order with the others.
    log = FakeLog()
    ledger = Ledger(log, StepHold(holding=True), (seen.append,), Clock())
    ledger.emit(ev.RunContinue(**CONTINUE))
    ledger.write_at_once(ev.FaultInjected(attempt=0, fault="kill", step=3, key="kill@step=3"))
    assert log.lines == []
    ledger.emit(ev.Step(**step(1)))
    assert log.lines == ["run_continue", "fault_injected", "step"]


# -- what the events say -----------------------------------------------------------------------------
def test_run_phase_follows_the_events_for_the_health_endpoint():
    phase = RunPhase(Clock(100.0))
    states = []
    for event in (
        ev.RunStart(t=100.0, run_id="r", workers=[1, 1], steps=3, config={}),
        ev.AttemptStart(t=101.0, attempt=0, world_size=1),
        ev.Step(t=102.0, **step(3)),
        ev.CheckpointSnapshot(t=103.0, attempt=0, step=3, stall_s=0.1),
        ev.CheckpointCommit(t=104.0, attempt=0, step=3, write_s=0.2, bytes=1, url="run/checkpoints/step-3"),
        ev.Failure(t=105.0, attempt=0, cause="kill", detail="gone"),
        ev.AttemptStart(t=110.0, attempt=1, world_size=1),  # restarting until the new attempt's first step
        ev.WorkerStart(t=110.5, attempt=1, rank=0, pid=7, node="n"),  # no state of its own
        ev.Step(t=112.0, **step(2)),
        ev.End(t=113.0, status="ok", step=3),
    ):
        phase.track(event)
        states.append(phase.phase["state"])
    assert states == [
        "starting", "starting", "training", "checkpointing", "training", "restarting", "restarting",
        "restarting", "training", "finished",
    ]  # fmt: skip
    assert phase.health(1, 112.0) == {
        "state": "finished", "started_t": 100.0, "attempt_t": 110.0, "step": 2, "attempt": 1, "last_step_t": 112.0,
    }  # fmt: skip
    phase.track(ev.End(t=114.0, status="failed", step=None))
    assert phase.phase["state"] == "failed"


def test_placement_groups_come_from_worker_start_events():
    groups = PlacementGroups()
    start = {"t": 1.0, "attempt": 0, "rank": 0, "pid": 7, "node": "n"}
    for event in (
        ev.WorkerStart(**start, placement_group="b"),
        ev.WorkerStart(**start, placement_group="a"),
        ev.WorkerStart(**start, placement_group="b"),
        ev.WorkerStart(**start, placement_group=""),
        *ev.read([{"t": 1.0, "event": "step", "placement_group": "c", **step(1)}]),
    ):
        groups.track(event)
    assert groups.ids() == ["a", "b"]


class FakeServer:
    def __init__(self, host: str, scraped: float | None = None, answers: bool = True):
        self.host, self.port, self.last_scrape, self.answers = host, 9100, scraped, answers
        self.observed: list[ev.Event] = []
        self.waited: list[tuple[float, float]] = []
        self.closed = False

    def observe(self, event: ev.Event) -> None:
        self.observed.append(event)

    def wait_for_scrape(self, after: float, timeout_s: float) -> bool:
        self.waited.append((after, timeout_s))
        return self.answers

    def close(self) -> None:
        self.closed = True


def test_metrics_url_names_the_node_for_an_endpoint_on_every_interface():
    assert Metrics(FakeServer("127.0.0.1")).url(lambda: "unused") == "http://127.0.0.1:9100/metrics"
    assert Metrics(FakeServer("0.0.0.0")).url(lambda: "10.0.0.7") == "http://10.0.0.7:9100/metrics"
    assert Metrics(FakeServer("::")).url(lambda: "fd00::7") == "http://[fd00::7]:9100/metrics"
    none = Metrics(None)
    none.observe(ev.Step(t=1.0, **step(1)))
    none.close()
    assert none.url(lambda: "x") is None and not none.last_scrape(10)


def test_the_last_scrape_is_waited_for_only_where_something_scrapes():
    slept: list[float] = []
    never = FakeServer("127.0.0.1", scraped=None)
    assert not Metrics(never, Clock(5.0), slept.append).last_scrape(30) and never.waited == []
    scraped = FakeServer("127.0.0.1", scraped=1.0)
    metrics = Metrics(scraped, Clock(5.0), slept.append)
    assert not metrics.last_scrape(0), "no linger asked"
    assert metrics.last_scrape(30) and scraped.waited == [(5.0, 30)] and slept == [Metrics.SCRAPE_ANSWER_S]
    late = FakeServer("127.0.0.1", scraped=1.0, answers=False)
    assert not Metrics(late, Clock(5.0), slept.append).last_scrape(30) and len(slept) == 1
    metrics.observe(ev.Step(t=1.0, **step(1)))
    metrics.close()
    assert scraped.observed == [ev.Step(t=1.0, **step(1))] and scraped.closed


def test_an_injection_fires_once_across_drivers():
    fired = FiredInjections(["raise@step=2"])  # an earlier driver's, from the ledger
    assert not fired.claim("raise@step=2")
    assert fired.claim("kill@step=5") and not fired.claim("kill@step=5")
    assert fired.keys() == ["kill@step=5", "raise@step=2"]


# -- the actor only delegates --------------------------------------------------------------------------
# Every method the actor has, and the thread it runs on (None: the default thread).
ACTOR_METHODS = {
    "emit": "ledger", "emit_many": "ledger", "telemetry": "ledger", "started": "ledger", "flush": "ledger",
    "close": "ledger", "fire": "ledger", "health": None, "placement_groups": None, "metrics_url": None,
    "last_scrape": "linger", "new_attempt": None, "beat": None, "heartbeats": None, "attempt_failed": None,
    "request_resize": None, "request_stop": None,
    "watch": "watch", "hold": "parts", "release": None, "report_part": "parts",
    "wait_parts": "parts", "fired_keys": None,
}  # fmt: skip


def _actor_methods() -> dict[str, str | None]:
    tree = ast.parse((HUB / "actor.py").read_text())
    (actor,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunHub"]
    methods: dict[str, str | None] = {}
    for node in actor.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            groups = [k.value.value for d in node.decorator_list if isinstance(d, ast.Call) for k in d.keywords]
            methods[node.name] = groups[0] if groups else None
            assert len(node.body) <= 4, f"RunHub.{node.name} does more than hand the call on"
    return methods


def test_the_actor_keeps_its_methods_and_their_threads():
    assert _actor_methods() == ACTOR_METHODS


def test_every_hub_method_a_caller_names_is_the_actors():
    """`hub.X.remote(...)` and `hub.call("X", ...)` anywhere in petatrain name a method of RunHub."""
    named: set[str] = set()
    for file in SRC.rglob("*.py"):
        text = file.read_text()
        named |= set(re.findall(r"\b_?hub\.(\w+)\.remote\(", text))
        named |= set(re.findall(r"\bhub\.call\(\s*\"(\w+)\"", text))
    assert named, "the search found no calls"
    assert named <= set(ACTOR_METHODS), sorted(named - set(ACTOR_METHODS))


def test_the_hubs_parts_load_without_ray():
    """Only actor.py imports Ray (handle.py when it starts the actor): the rest runs where Ray is not loaded."""
    import subprocess
    import sys

    parts = [f"petatrain.runtime.hub.{f.stem}" for f in sorted(HUB.glob("*.py")) if f.stem != "actor"]
    code = f"import sys; import {', '.join(parts)}; assert 'ray' not in sys.modules, 'ray'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
