"""Ray Train's controller: its synchronization actor started only when something calls it,
and the controller itself run by the driver instead of as an actor of its own.

Ray Train starts a `SynchronizationActor` for every worker group: the barrier behind
`ray.train.report` and `ray.train.collective`. petatrain's loop calls neither, and the actor
is one more Python process importing Ray Train on every restart's path, then idling (Ray's
signal-check loop) on the cores the ranks train on.
In the controller's process, the worker group gets an `OnDemandSyncActor` instead: the
first method call on it (from a user's `ray.train.report`, say) starts the real actor under
a name unique to the worker group, so the controller and every rank reach the same one.
Its owner is the process that started it (a rank, where the stock actor's is the
controller), so it ends with that rank; a rank's failure ends the worker group anyway.

`DriverController` is the same controller as an object of the driver process, its control
loop run on the driver's thread: Ray Train makes it an actor, one more process that imports
Ray Train and torch before any worker can start, and then idles for the whole run, taking
CPU from training where the workers fill the machine (benchmarks/recovery.py measures both).

Imported by the controller's process (the actor class is pickled by reference) and, on
the driver, only once Ray Train is. Every private name used here is checked by
tests/test_ray_internals.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ray
from ray.train.v2._internal.constants import ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.controller.state import AbortedState
from ray.train.v2._internal.execution.worker_group import state as group_state
from ray.train.v2._internal.execution.worker_group import worker_group as group_module

from petatrain.observe.events import CheckpointDrain

log = logging.getLogger(__name__)


class OnDemandSyncActor:
    """Stands in for an actor handle; starts the actor (or finds the one a rank started) on first use."""

    def __init__(self, actor_class: Any, options: dict[str, Any], kwargs: dict[str, Any]):
        self._actor_class, self._options, self._kwargs = actor_class, options, kwargs
        self._name = f"petatrain-sync-{uuid.uuid4().hex}"
        self._handle = None

    @property
    def started(self) -> bool:
        return self._handle is not None

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        if self._handle is None:
            self._handle = self._actor_class.options(name=self._name, get_if_exists=True, **self._options).remote(
                **self._kwargs
            )
        return getattr(self._handle, method)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None}  # each process finds the actor by its name

    def kill(self) -> None:
        handle = self._handle
        if handle is None:
            with contextlib.suppress(ValueError):  # never started: nothing to end
                handle = ray.get_actor(self._name)
        if handle is not None:
            ray.kill(handle)


class _OnDemand:
    """`SynchronizationActor` as the worker group calls it: `.options(...).remote(...)`."""

    def __init__(self, actor_class: Any, options: dict[str, Any] | None = None):
        self.actor_class, self._options = actor_class, options or {}

    def options(self, **options: Any) -> _OnDemand:
        return _OnDemand(self.actor_class, {**self._options, **options})

    def remote(self, **kwargs: Any) -> OnDemandSyncActor:
        return OnDemandSyncActor(self.actor_class, self._options, kwargs)


def use_on_demand_sync_actor() -> None:
    """Make this process's worker groups start their synchronization actor on demand (idempotent)."""
    if isinstance(group_module.SynchronizationActor, _OnDemand):
        return
    group_module.SynchronizationActor = _OnDemand(group_module.SynchronizationActor)
    shutdown = group_state._shutdown_sync_actor

    def _shutdown_sync_actor(sync_actor):
        if isinstance(sync_actor, OnDemandSyncActor):
            sync_actor.kill()
        else:
            shutdown(sync_actor)

    group_state._shutdown_sync_actor = _shutdown_sync_actor


class LeanTrainController(TrainController):
    """Ray Train's controller; its worker groups start the synchronization actor on demand."""

    def __init__(self, *args: Any, **kwargs: Any):
        use_on_demand_sync_actor()
        super().__init__(*args, **kwargs)


class CommitDrain(WorkerGroupCallback):
    """Before Ray Train kills a failed attempt's workers, rank 0 finishes the checkpoint it is writing.

    Ray Train ends an attempt at the first poll that shows a rank's error and kills every
    worker. A fault on another rank while rank 0 uploads its file (its part of the
    checkpoint the others already wrote) or commits would lose that checkpoint, and the
    next attempt would recompute a whole interval. So, on a failure: the hub learns which
    ranks are gone (a checkpoint still waiting for one of their parts is given up at once,
    and no survivor counts as hung meanwhile), and unless rank 0 is among them, it is given
    up to `timeout_s` to finish its write. The outcome goes to the ledger
    (`checkpoint_drain`). A clean end has nothing in flight: the loop closes its writer.
    """

    TIMEOUT_S = 30.0  # the longest a restart waits for rank 0's write (a write that long saves minutes of steps)

    def __init__(self, hub: Any, attempt: int, timeout_s: float = TIMEOUT_S):
        self.hub, self.attempt, self.timeout_s = hub, attempt, timeout_s

    def before_worker_group_shutdown(self, worker_group: Any) -> None:
        from petatrain.train.checkpoint import finish_writes

        status = worker_group.get_latest_poll_status()
        errors = {rank: s.error for rank, s in (status.worker_statuses if status else {}).items() if s.error}
        if not errors:
            return
        gone = (WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError)  # the process died or stopped answering
        lost = sorted(rank for rank, error in errors.items() if isinstance(error, gone))
        t0 = time.monotonic()
        outcome: dict[str, Any] = {"done": None, "committed": None}  # rank 0 gone: unknown
        try:
            ray.get(self.hub.attempt_failed.remote(self.attempt, lost), timeout=5)
            if 0 not in lost:
                rank0 = next(w for w in worker_group.get_workers() if w.distributed_context.world_rank == 0)
                outcome = ray.get(rank0.execute_async(finish_writes, self.timeout_s), timeout=self.timeout_s + 5)
        except Exception as exc:  # rank 0 died meanwhile, or the hub is gone: the shutdown goes on
            log.warning("letting rank 0 finish its checkpoint write failed: %s", exc)
        waited = round(time.monotonic() - t0, 3)
        drain = CheckpointDrain(attempt=self.attempt, lost=lost, waited_s=waited, **outcome)
        with contextlib.suppress(Exception):
            self.hub.emit.remote(drain)


class NoControllerActor:
    """The controller's actor handle in the workers' train context, when the controller has none.

    Ray Train gives each worker its controller's handle for one call,
    `ray.train.get_all_reported_checkpoints()`, which petatrain's loop does not make (its
    checkpoints are its own, under RUN/checkpoints); anything else that calls it gets this error.
    """

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        raise RuntimeError(
            f"ray.train's controller call {method!r} is not available: petatrain runs Ray Train's controller in "
            "its driver, not as an actor; petatrain's checkpoints are under RUN/checkpoints"
        )


class _DriverRuntimeContext:
    """`ray.get_runtime_context()` whose `current_actor`, where Ray's would raise (not an actor), is a stand-in."""

    def __init__(self, context: Any):
        self._context = context

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    @property
    def current_actor(self):
        try:
            return self._context.current_actor
        except RuntimeError:  # "only available in an actor": the driver
            return NoControllerActor()


class _DriverRay:
    """The `ray` module as Ray Train's worker group module sees it in the driver's process."""

    def __init__(self, module: Any):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def get_runtime_context(self) -> _DriverRuntimeContext:
        return _DriverRuntimeContext(self._module.get_runtime_context())


def can_run_in_driver() -> bool:
    """Ray's internals this module relies on are where it expects them, and the driver is on the cluster.

    A Ray Client driver (`ray://`) runs off the cluster: every poll of the workers would cross
    the client's connection, so its controller stays an actor on the cluster.
    """
    from ray.util.client import ray as client

    return (
        (getattr(group_module, "ray", None) is ray or isinstance(group_module.ray, _DriverRay))
        and callable(getattr(group_module.WorkerGroup, "_init_train_context_on_workers", None))
        and not client.is_connected()
    )


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no event loop runs in this thread
        return False
    return True


class DriverController(LeanTrainController):
    """Ray Train's controller as an object of the driver: `run_here()` runs its control loop on this thread.

    What changes from the actor: the worker group, its workers and placement group are owned
    by the driver (they end with it, as they end with the controller actor); the workers get
    `NoControllerActor` for the controller's handle; Ray Train's structured controller log
    (a `logging.config.dictConfig` of the process) is left off, since the process is the
    driver; and an interrupt (Ctrl-C) aborts the worker group from here.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        if not isinstance(group_module.ray, _DriverRay):
            group_module.ray = _DriverRay(group_module.ray)
        with _env(ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR, "0"):
            super().__init__(*args, **kwargs)

    def run_here(self):
        """Run the control loop to its end; Ray Train's `Result` (its `error` set if training failed)."""
        try:
            if _loop_running():  # called from a coroutine (a notebook): a loop of its own, on a thread of its own
                with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="petatrain-controller") as pool:
                    pool.submit(asyncio.run, self.run()).result()
            else:  # the usual case; a Ctrl-C cancels the loop and raises KeyboardInterrupt here
                asyncio.run(self.run())
        except BaseException:
            self.abort_here()
            raise
        return self.get_result()

    def abort_here(self) -> None:
        """`abort()` without its actor exit: stop the workers of a run that did not end."""
        if self.get_state().is_terminal():
            return
        try:
            self._controller_callback_manager.invoke_best_effort("before_controller_abort")
            if self._worker_group:
                self._worker_group.abort()
            self._set_state(AbortedState())
        except Exception:
            log.exception("aborting Ray Train's worker group failed")
