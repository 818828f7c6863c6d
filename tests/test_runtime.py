"""The control plane on a local Ray: controller in the driver, standby, watchdog, hub, placement groups."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import tiny, train, train_workers
from petatrain.errors import ConfigError
from petatrain.observe.ledger import read_events


def test_placement_group_of_a_dead_controller_is_removed_between_attempts(ray_local):
    """Attempts run without Ray Train's placement-group cleaner actor; the supervisor frees
    what a failed attempt left reserved, or the next attempt's workers could never start."""
    from ray.util.placement_group import placement_group, placement_group_table

    from petatrain.runtime.cluster import remove_leftover_placement_groups
    from petatrain.runtime.startup.lean import trainer_class

    # Tasks of earlier tests (a session fixture's Ray Data ingest) may still be giving their CPUs back.
    total = ray_local.cluster_resources().get("CPU", 0)
    deadline = time.monotonic() + 30
    while ray_local.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    free = ray_local.available_resources().get("CPU", 0)
    assert free == total, "the session's Ray never became idle"
    group = placement_group([{"CPU": 1}])
    ray_local.get(group.ready(), timeout=30)
    assert ray_local.available_resources().get("CPU", 0) == free - 1
    remove_leftover_placement_groups()
    assert placement_group_table(group)["state"] == "REMOVED"
    assert trainer_class().__name__ == "LeanTorchTrainer"  # Ray's internals still where we expect them


def test_local_attempts_send_no_autoscaler_requests(monkeypatch):
    """On the local Ray that train starts there is no autoscaler: the attempt's scaling policy
    sends it nothing (its coordinator would be one more Ray process on the start-up path)."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

    from petatrain.runtime.startup.lean import trainer_class as lean_trainer_class

    class Started(Exception):
        pass

    seen = {}

    def start(kwargs):  # where the controller actor would start: look at what it would get
        seen.update(kwargs)
        raise Started

    scaling = ScalingConfig(num_workers=2)
    for local in (True, False):
        trainer_class = lean_trainer_class(local=local)
        monkeypatch.setattr(trainer_class, "_start_controller", staticmethod(start))
        trainer = trainer_class(lambda: None, scaling_config=scaling)
        with pytest.raises(Started):
            trainer._initialize_and_run_controller(scaling_policy=FixedScalingPolicy(scaling), callbacks=[])
        policy = seen["scaling_policy"]
        assert isinstance(policy, FixedScalingPolicy)
        if local:
            policy.after_controller_start(None)  # the stock policy would create the coordinator actor here
            policy.make_decision_for_non_running_worker_group()
            assert policy._coordinator_client is None
        else:
            assert type(policy) is FixedScalingPolicy  # a cluster given by address may autoscale


def test_heartbeat_dates_the_last_step_not_the_message(ray_local, tmp_path):
    """The watchdog measures a hang from when the last step ended: a rank's heartbeat says how
    long ago that was, and the hub dates the beat by it on its own clock."""
    import time

    from petatrain.observe.events import Eval
    from petatrain.runtime.hub.actor import RunHub
    from petatrain.runtime.worker import Telemetry

    sent = []

    class Hub:
        class telemetry:  # stands in for the actor method
            @staticmethod
            def remote(*args):
                sent.append(args)

    beats = Telemetry(Hub, attempt=0, rank=1, node_id="node")
    beats.flush()
    assert sent[-1][3] == -1 and sent[-1][-1] == 0.0  # no step yet: dated on arrival
    beats.progress(5, now=True)
    time.sleep(0.3)
    note = Eval(attempt=0, step=5, loss=1.0)
    beats.record(note)
    beats.flush()
    events, _, _, step, _, _, age = sent[-1]
    assert events == [note] and step == 5 and 0.3 <= age < 2.0

    hub = RunHub.remote(str(tmp_path), None)
    ray_local.get(hub.new_attempt.remote(0))
    assert ray_local.get(hub.telemetry.remote([], 0, 1, 5, 123, "node", 3.0)) == (None, False), "nothing asked"
    beat = ray_local.get(hub.heartbeats.remote())[1]
    assert beat["step"] == 5 and 3.0 <= time.time() - beat["t"] < 6.0
    # What the driver asks reaches the ranks in the answers: a resize of this attempt, the run's end.
    ray_local.get([hub.request_resize.remote(0, 4), hub.request_stop.remote()])
    assert ray_local.get(hub.telemetry.remote([], 0, 0, 6, 123, "node")) == (4, True)
    assert ray_local.get(hub.telemetry.remote([], 1, 0, 0, 123, "node")) == (None, True), "the stop is the run's"
    ray_local.kill(hub)


def test_waiting_on_its_own_checkpoint_write_keeps_a_rank_alive_but_waiting_for_peers_does_not(tmp_path):
    """The loop waits on its writer (a synchronous write, rank 0's commit of a preemption's
    checkpoint): that is progress for the watchdog while this rank writes (here two storage
    errors retried, >= 0.3 s of back-off), not while rank 0 waits for the other ranks' parts,
    since a peer that never writes its part is a hang."""
    import torch

    from petatrain.train.checkpoint import CheckpointWriter, Snapshot, StorageFaults

    parts: dict = {}
    beats: list[float] = []
    waited: list[tuple[float, float]] = []

    def wait_parts(step: int, world: int, timeout: float) -> dict:
        t0 = time.monotonic()
        time.sleep(1.0)  # a slow peer
        waited.append((t0, time.monotonic()))
        return dict(parts)

    faults = StorageFaults()
    faults.arm(2)
    writer = CheckpointWriter(
        str(tmp_path),
        None,
        report_part=lambda s, r, f: parts.update(f),
        wait_parts=wait_parts,
        on_commit=lambda info: None,
        faults=faults,
        keepalive=lambda: beats.append(time.monotonic()),
        keepalive_s=0.05,
    )
    meta = {"loader": {"position": 1}, "strategy": "ddp", "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    writer.submit(Snapshot(step=1, rank=0, world_size=2, tensors={"model/w": torch.ones(4)}, meta=meta))
    writer.wait()
    writer.close()
    assert writer.error is None and writer.committed_step == 1 and faults.raised == 2
    ((t0, t1),) = waited
    assert sum(b < t0 for b in beats) >= 2, "alive while its own writes were retried"
    # ~18 beats if it were alive while waiting; the margin is for a keepalive checked just before.
    assert not [b for b in beats if t0 + 0.25 < b < t1 - 0.05], "not while waiting for the other ranks"


def test_watchdog_long_poll_answers_when_there_is_something_to_act_on(ray_local, tmp_path):
    """RunHub.watch holds the watchdog's call until the first step (unless announced), a hang
    is due, a new attempt starts, or its wait ends; a heartbeat moves the hang deadline."""
    from petatrain.runtime.hub.actor import RunHub

    hub = RunHub.remote(str(tmp_path), None)
    ray_local.get(hub.new_attempt.remote(0))

    def timed(call) -> tuple[dict, float]:
        started = time.monotonic()
        return ray_local.get(call, timeout=30), time.monotonic() - started

    seen, took = timed(hub.watch.remote(0, 1.0, False, 0.5))
    assert seen["beats"] == {} and seen["stale_s"] is None and 0.4 < took < 3, "no beat yet: nothing is due"
    ray_local.get(hub.beat.remote(0, 0, -1, 1, "node"))
    seen, took = timed(hub.watch.remote(0, 1.0, False, 20.0))
    assert seen["stale_s"] >= 3.0 and 2.5 < took < 6, "before the first step a hang is due after 3 x timeout"
    ray_local.get(hub.beat.remote(0, 0, 3, 1, "node"))
    seen, took = timed(hub.watch.remote(0, 1.0, False, 20.0))
    assert seen["stepped"] and seen["stale_s"] is None and took < 0.5, "the first step: at once, unless announced"
    waiting = hub.watch.remote(0, 1.0, True, 20.0)
    for step in (4, 5, 6):  # progress keeps moving the deadline
        time.sleep(0.6)
        ray_local.get(hub.beat.remote(0, 0, step, 1, "node"))
    seen, took = timed(waiting)
    assert seen["beats"][0]["step"] == 6 and seen["stale_s"] >= 1.0, "answered once the last beat was 1 s old"
    seen, took = timed(hub.watch.remote(0, 5.0, True, 0.5))
    assert seen["stale_s"] is None and 0.4 < took < 3, "the wait ends before a hang is due: not hung"
    waiting = hub.watch.remote(0, 5.0, True, 20.0)
    time.sleep(0.3)
    ray_local.get(hub.new_attempt.remote(1))
    seen, took = timed(waiting)
    assert seen["beats"] == {} and took < 1, "a new attempt: at once"
    ray_local.kill(hub)


@pytest.mark.slow
def test_restart_runs_the_controller_started_while_the_attempt_trained(token_dataset, tmp_path, monkeypatch):
    """Where Ray Train's controller is an actor, once an attempt steps the next attempt's
    controller is started and waits; the restart after a kill runs it instead of starting a
    process then."""
    monkeypatch.setenv("PETATRAIN_CONTROLLER", "actor")
    # One rank (the controllers are what is checked); the kill ~2 s after the first step, which
    # started the standby (a long poll's answer away).
    one = ("parallel.workers=1", "train.steps=120")
    summary = train(tiny(token_dataset, *one), tmp_path, "kill@step=100,rank=0")
    assert [f.cause for f in summary.failures] == ["kill"]
    starts = [e for e in read_events(str(tmp_path)) if e["event"] == "attempt_start"]
    assert [(e["controller"], e["warm_controller"]) for e in starts] == [("actor", False), ("actor", True)]


@pytest.mark.slow
def test_controller_runs_in_the_driver_and_an_interrupt_ends_its_workers(token_dataset, tmp_path):
    """By default Ray Train's controller is an object of the driver (no process of its own; a
    restart with it: the coroutine test below). Ctrl-C in the driver ends the run's workers at once
    instead of leaving them to train with no controller."""
    import threading

    before = train_workers()
    seen: set[int] = set()

    def interrupt_once_training() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen.update(train_workers() - before)
            if len(seen) == 2:
                time.sleep(3)  # into the loop
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    threading.Thread(target=interrupt_once_training, daemon=True).start()
    # Ctrl-C as a terminal delivers it: a shell starts background jobs (make test &) with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(tiny(token_dataset, "train.steps=3000"), tmp_path / "interrupted")  # ends anyway
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(seen) == 2, "the workers never started"
    deadline = time.monotonic() + 15
    while train_workers() & seen:
        assert time.monotonic() < deadline, "the interrupted run's workers are still alive"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_run_started_from_a_coroutine_runs_the_controller_on_a_thread(token_dataset, tmp_path):
    """A notebook cell runs inside an event loop, where the controller's own `asyncio.run` would
    fail: it runs on a thread of its own, and a fault is still recovered. The controller is the
    driver's (the default): the standby has nothing to start, and the restart none to run."""
    import asyncio
    import threading

    names: set[str] = set()
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            names.update(t.name for t in threading.enumerate())
            time.sleep(0.05)

    async def cell():
        return train(tiny(token_dataset, "parallel.workers=1", "train.steps=10"), tmp_path, "raise@step=4,rank=0")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = asyncio.run(cell())
    finally:
        watching.set()
        watcher.join()
    assert done.steps == 10 and [f.cause for f in done.failures] == ["exception"]
    assert any(n.startswith("petatrain-controller") for n in names), sorted(names)
    starts = [e for e in read_events(str(tmp_path)) if e["event"] == "attempt_start"]
    assert [(e["controller"], e["warm_controller"]) for e in starts] == [("driver", False), ("driver", False)]


def test_controller_place_is_driver_or_actor(monkeypatch):
    from petatrain.constants import controller_mode

    monkeypatch.setenv("PETATRAIN_CONTROLLER", "Driver")
    with pytest.raises(ConfigError, match=r"driver \(the default\) or actor"):
        controller_mode()
    monkeypatch.delenv("PETATRAIN_CONTROLLER")
    assert controller_mode() == "driver"


def test_workers_of_a_driver_controller_get_a_stand_in_for_its_handle(ray_local):
    """Ray Train hands each worker its controller's actor handle (for one call petatrain's
    loop does not make); a driver has none, so the workers get one that says why."""
    from ray.train.v2._internal.execution.worker_group import worker_group

    from petatrain.runtime._ray import controller

    with pytest.raises(RuntimeError):
        ray_local.get_runtime_context().current_actor  # noqa: B018 (what Ray Train would call in the driver)
    context = controller._DriverRay(ray_local).get_runtime_context()
    assert isinstance(context.current_actor, controller.NoControllerActor)
    assert context.get_node_id() == ray_local.get_runtime_context().get_node_id()
    with pytest.raises(RuntimeError, match="runs Ray Train's controller in its driver"):
        context.current_actor.get_all_reported_checkpoints.remote(0)
    assert controller.can_run_in_driver() and callable(worker_group.WorkerGroup._init_train_context_on_workers)


def test_standby_is_used_only_for_the_attempt_and_world_it_was_built_for():
    from petatrain.runtime.startup.standby import Standby

    built, discarded = [], []

    class Trainer:
        def __init__(self, attempt, world):
            self.key = (attempt, world)
            built.append(self.key)

        def prepare(self):  # a controller actor started: True
            self.prepared = True
            return True

        def discard(self):
            discarded.append(self.key)

    standby = Standby(Trainer)
    standby.prepare(0, 2)  # attempt 0 on 2 workers trains: attempt 1's controller starts
    assert built == [(1, 2)]
    trainer = standby.take(1, 2)
    assert trainer.key == (1, 2) and trainer.prepared and standby.take(1, 2) is None
    standby.prepare(1, 2)
    assert standby.take(2, 1) is None, "a node was lost: the next attempt needs another world size"
    assert discarded == [(2, 2)]
    standby.prepare(2, 1)
    standby.discard()  # the run ended: the waiting controller goes
    assert discarded == [(2, 2), (3, 1)]

    off = Standby(Trainer, enabled=False)  # faults.standby: false
    off.prepare(0, 2)
    assert off.take(1, 2) is None and built[-1] == (3, 1), "nothing started"


def test_synchronization_actor_starts_only_when_called(ray_local):
    """Worker groups get a stand-in for Ray Train's SynchronizationActor: no process until a
    method is called; then one actor, the same for every process holding the stand-in."""
    from ray.train.v2._internal.execution.checkpoint.sync_actor import SynchronizationActor
    from ray.train.v2._internal.execution.worker_group import state, worker_group

    from petatrain.runtime._ray import controller

    stock = worker_group.SynchronizationActor  # as it is: a run's controller in this driver already replaced it
    stock_shutdown = state._shutdown_sync_actor
    try:
        controller.use_on_demand_sync_actor()
        controller.use_on_demand_sync_actor()  # idempotent
        assert worker_group.SynchronizationActor.actor_class is SynchronizationActor
        # as WorkerGroup._start calls it
        sync = worker_group.SynchronizationActor.options(num_cpus=0).remote(timeout_s=30, warn_interval_s=10)
        assert isinstance(sync, controller.OnDemandSyncActor) and not sync.started
        with pytest.raises(ValueError):
            ray_local.get_actor(sync._name)
        state._shutdown_sync_actor(sync)  # a group that never used it: nothing to end

        @ray_local.remote(num_cpus=0)
        class Rank:  # as a Ray Train worker holds the stand-in (in its train context): pickled, in another process
            def broadcast(self, held, rank):
                self.sync = held  # an actor lives while a handle does
                return ray_local.get(
                    held.broadcast_from_rank_zero.remote(
                        world_rank=rank, world_size=2, data=f"from {rank}", caller_method_name="test"
                    )
                )

        ranks = [Rank.remote() for _ in range(2)]
        done = [rank.broadcast.remote(sync, r) for r, rank in enumerate(ranks)]
        assert ray_local.get(done, timeout=60) == ["from 0", "from 0"]
        assert not sync.started, "the ranks started it; this process has not called it"
        actor = ray_local.get_actor(sync._name)
        ray_local.get(sync.get_counter.remote())  # this process finds the ranks' actor by name
        assert sync.started and sync._handle._actor_id == actor._actor_id
        state._shutdown_sync_actor(sync)
        # ray.kill returns before the actor is dead: a call made at once can still be answered
        # (it was, once, in a full run). Ended means: calls fail from some point on.
        deadline = time.monotonic() + 30
        while True:
            try:
                ray_local.get(actor.get_counter.remote(), timeout=30)
            except ray_local.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "shutdown did not end the synchronization actor"
            time.sleep(0.1)
        for rank in ranks:
            ray_local.kill(rank)
    finally:
        worker_group.SynchronizationActor = stock
        state._shutdown_sync_actor = stock_shutdown


def test_a_ray_client_server_that_fails_to_start_the_drivers_server_is_asked_again(monkeypatch):
    """Ray's client server forks a server per driver, and that process sometimes dies at once
    (gRPC and fork); a new connection gets a new one. Other connection errors stay one error."""
    import ray

    from petatrain.errors import PetatrainError
    from petatrain.runtime import cluster

    calls: list[str] = []

    def init(address=None, **kwargs):
        calls.append(address)
        if len(calls) == 1:
            raise ConnectionError("Initialization failure from server: ... Starting Ray client server failed. See ...")
        if address == "ray://127.0.0.1:2":
            raise ConnectionError("ray client connection timeout")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(cluster, "_check_token", lambda address: None)
    monkeypatch.setattr("petatrain.runtime._ray.silence_worker_logs", lambda: None)
    cluster.init_ray("ray://127.0.0.1:1")
    assert calls == ["ray://127.0.0.1:1", "ray://127.0.0.1:1"]
    calls.clear()
    calls.append("")  # the next call is not the first: no start failure this time
    with pytest.raises(PetatrainError, match=r"cannot reach the Ray cluster at 'ray://127\.0\.0\.1:2'"):
        cluster.init_ray("ray://127.0.0.1:2")
    assert calls == ["", "ray://127.0.0.1:2"]
