"""Ray Train's controller, with its synchronization actor started only when something calls it.

Ray Train starts a `SynchronizationActor` for every worker group: the barrier behind
`ray.train.report` and `ray.train.collective`. petatrain's loop calls neither, and the actor
is one more Python process importing Ray Train, ~1.4 s of CPU on every restart's path on
2 cores, and ~0.8% of a core for as long as it idles (Ray's 10 ms signal-check loop).
In the controller's process, the worker group gets an `OnDemandSyncActor` instead: the
first method call on it (from a user's `ray.train.report`, say) starts the real actor under
a name unique to the worker group, so the controller and every rank reach the same one.
Its owner is the process that started it (a rank, where the stock actor's is the
controller), so it ends with that rank; a rank's failure ends the worker group anyway.

Imported by the controller's process (the actor class is pickled by reference) and, on
the driver, only once Ray Train is.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import ray
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.worker_group import state as group_state
from ray.train.v2._internal.execution.worker_group import worker_group as group_module


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
