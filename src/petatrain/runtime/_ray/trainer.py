"""Ray Train's `TorchTrainer` without the per-attempt helper processes petatrain does not use.

Each attempt is a new `fit()`, and every helper actor is one more Python process that imports
Ray Train while the workers start, then idles beside them taking CPU from training:

- Ray Data's dataset manager (training reads the petatrain loader, not `datasets=`) and the
  placement-group cleaner (for a controller that dies: `runtime.cluster.remove_leftover_placement_groups`
  does that job between attempts) are left out.
- On the local Ray that `petatrain train` starts itself, the scaling policy leaves out its
  requests to the autoscaler's coordinator: there is no autoscaler, and the coordinator is one
  more Ray process (importing Ray Data) on the first attempt's path.
- The worker groups start their synchronization actor only if something calls it (`controller.py`).
- With `controller="driver"` (the default; `PETATRAIN_CONTROLLER=actor` chooses the actor) the
  controller is an object of the driver, its loop run on the thread that calls `fit()`
  (`DriverController`): no controller process to start on every restart's path, nor to idle
  beside the workers for the whole run. Where it is an actor (also under a Ray Client driver),
  `prepare()` starts it ahead of `fit()` (`runtime.startup.standby.Standby`), and a finished controller
  is killed rather than left to exit gracefully.

benchmarks/recovery.py measures what each of these saves. Importing this module fails (and
`runtime.startup.lean` falls back to the stock `TorchTrainer`) if Ray's internals moved;
tests/test_ray_internals.py says which.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.constants import (
    DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
    RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
    get_env_vars_to_propagate,
)
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

from petatrain.runtime._ray import controller as lean

# TorchTrainer's methods LeanTorchTrainer overrides or calls.
TRAINER_HOOKS = ("_create_default_callbacks", "_initialize_and_run_controller", "_register_sigint_handler")
_UNUSED_CALLBACKS = (DatasetsCallback, PlacementGroupCleanerCallback)


def on_demand_sync_actor_possible() -> bool:
    return hasattr(lean.group_module, "SynchronizationActor") and hasattr(lean.group_state, "_shutdown_sync_actor")


@functools.cache
def trainer_class(local: bool = False, controller: str = "driver") -> type:
    """LeanTorchTrainer for a local Ray (`local`) and a controller in the driver or an actor;
    the stock TorchTrainer if Ray's trainer no longer has the methods it overrides."""
    if not all(hasattr(TorchTrainer, name) for name in TRAINER_HOOKS):
        return TorchTrainer
    on_demand = on_demand_sync_actor_possible()
    in_driver = controller == "driver" and on_demand and lean.can_run_in_driver()
    controller_class = lean.LeanTrainController if on_demand else TrainController
    attrs = {"local_ray": local, "controller_in_driver": in_driver, "controller_class": controller_class}
    return type("LeanTorchTrainer", (LeanTorchTrainer,), attrs)


def _controller_actor(controller_class: type, kwargs: dict[str, Any]) -> Any:
    """The controller as the actor `DataParallelTrainer._initialize_and_run_controller` creates."""
    env_vars = get_env_vars_to_propagate()
    env_vars.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    return ray.remote(
        num_cpus=0,
        label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
        runtime_env={"env_vars": env_vars},
    )(controller_class).remote(**kwargs)


class NoAutoscalerPolicy(FixedScalingPolicy):
    """A fixed worker count on a cluster without an autoscaler: nothing to request."""

    def _maybe_send_resource_request(self):
        pass

    def _send_resource_request(self):
        pass

    def after_controller_start(self, train_run_context):
        pass

    async def before_controller_shutdown(self):
        pass

    def before_controller_abort(self):
        pass


class LeanTorchTrainer(TorchTrainer):
    local_ray = False  # on the local Ray petatrain started: no autoscaler to ask
    controller_in_driver = False
    controller_class: type = TrainController
    _standby = None  # a controller actor started by prepare(), run by the next fit()
    drain = None  # (hub, attempt) for CommitDrain
    _preparing = False

    def _start_controller(self, kwargs: dict[str, Any]) -> Any:
        """The controller: the driver's object (`run_here()` runs it), or an actor (`run.remote()`)."""
        if self.controller_in_driver:
            return lean.DriverController(**kwargs)
        return _controller_actor(self.controller_class, kwargs)

    def prepare(self) -> bool:
        """Start this trainer's controller now (its process imports in the background); fit() runs it.

        False when there is nothing to start ahead: a controller run by the driver has no process.
        """
        if self.controller_in_driver:
            return False
        self._preparing = True
        try:
            self.fit()
        finally:
            self._preparing = False
        return True

    def discard(self) -> None:
        if self._standby is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._standby)
            self._standby = None

    def _create_default_callbacks(self):
        callbacks = [c for c in super()._create_default_callbacks() if not isinstance(c, _UNUSED_CALLBACKS)]
        if self.drain is not None:  # first: before the backend's shutdown destroys the process groups
            callbacks.insert(0, lean.CommitDrain(*self.drain))
        return callbacks

    def _initialize_and_run_controller(self, **kwargs):
        if self.local_ray and type(kwargs.get("scaling_policy")) is FixedScalingPolicy:
            kwargs["scaling_policy"] = NoAutoscalerPolicy(self.scaling_config)
        if self.controller_in_driver:
            return self._start_controller(kwargs).run_here()
        if self._preparing:
            self._standby = self._start_controller(kwargs)
            return _NOT_RUN
        controller, self._standby = self._standby, None
        if controller is None:
            controller = self._start_controller(kwargs)
        main, interrupt = threading.current_thread() is threading.main_thread(), signal.getsignal(signal.SIGINT)
        if main:
            # Ray Train's handler aborts this controller; it is put back once the attempt ends,
            # or a Ctrl-C after it would call a killed controller and exit with status 0.
            self._register_sigint_handler(controller)
        try:
            ray.get(controller.run.remote())
            result = ray.get(controller.get_result.remote())
        finally:
            if main:
                signal.signal(signal.SIGINT, interrupt)
        # Dropping the handle would let the finished controller exit gracefully, and a Ray
        # worker's graceful exit imports ray.dag, just when the next attempt's workers start.
        # Its work is done: end it at once.
        ray.kill(controller)
        return result


class _NotRun:
    """What `fit()` returns when `prepare()` only started the controller."""

    error = None


_NOT_RUN = _NotRun()
