"""One attempt as Ray Train runs it: the TorchTrainer of N workers, the standby, fit()."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from petatrain import constants
from petatrain.config import JobConfig
from petatrain.runtime import cluster, spares
from petatrain.runtime.supervisor import use_gpu
from petatrain.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


@functools.cache
def trainer_class(local: bool = False, controller: str = "driver") -> type:
    """petatrain's lean TorchTrainer (runtime._ray.trainer), or the stock one if Ray's internals moved."""
    try:
        from petatrain.runtime._ray.trainer import trainer_class as lean
    except (ImportError, AttributeError):
        log.warning("Ray's internals moved (tests/test_ray_internals.py says which): using the stock TorchTrainer")
        from ray.train.torch import TorchTrainer

        return TorchTrainer
    return lean(local, controller)


def make_trainer(cfg: JobConfig, payload: Any, world: int, run_id: str, attempt: int, *, local: bool) -> Any:
    """The TorchTrainer of one attempt: N workers, gloo or NCCL, no retries of its own.

    `local`: on a Ray this process started (no autoscaler, no Ray Client).
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    gpu = use_gpu(cfg, ray.cluster_resources().get("GPU", 0))
    resources = {"CPU": cfg.resources.cpus_per_worker} | ({"GPU": 1} if gpu else {})
    storage = os.path.join(os.path.expanduser("~"), ".cache", "petatrain", "ray-train")
    trainer = trainer_class(local=local, controller=constants.controller_mode())(
        entry,
        train_loop_config={"payload": payload},
        torch_config=TorchConfig(
            backend="nccl" if gpu else "gloo", timeout_s=int(max(60, 3 * cfg.faults.hang_timeout_s))
        ),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=f"petatrain-{run_id}-attempt{attempt}",
            storage_path=storage,
            failure_config=FailureConfig(max_failures=0),  # the supervisor decides, not Ray Train
            worker_runtime_env=spares.worker_runtime_env(cfg.resources.cpus_per_worker) if spares.wanted(cfg) else None,
        ),
    )
    trainer.drain = (payload.hub, attempt)  # a failure lets rank 0 finish its checkpoint write (CommitDrain)
    return trainer


def entry(config: dict[str, Any]) -> None:
    """What Ray Train runs on every rank: the worker loop, given what Ray says about the rank."""
    from petatrain.runtime.worker import RankEnv
    from petatrain.train.loop import train_worker

    payload = config["payload"]
    train_worker(payload, RankEnv.from_ray(payload.hub, payload.attempt))


def fit(trainer: Any, attempt: int, world: int, watch: Watchdog, *, shared_job: bool = False) -> BaseException | None:
    """One attempt; returns its error or None. The watchdog runs while it trains. `shared_job`: other
    runs train in this Ray job (a search's trials): only this run's placement groups are removed."""
    watch.start(attempt, world)
    try:
        trainer.fit()
        return None
    except Exception as exc:
        import ray

        own = ray.get(watch.hub.placement_groups.remote()) if shared_job else None
        cluster.remove_leftover_placement_groups(own)
        return exc
    finally:
        watch.pause()


class Standby:
    """The next attempt's trainer, its Ray Train controller started while this attempt trains.

    A restart would otherwise begin by starting a controller process (Python, Ray, Ray Train
    and torch imports) before any worker could start. Once an attempt has made its first step,
    the watchdog asks for the next attempt's controller; it waits, idle, until a failure needs
    it (or the run ends and it is discarded). It is used only for the attempt number and world
    size it was built for: after a lost node the next attempt builds a controller for the
    workers that are left. Its start-up takes CPU: free where the driver's node has a core to
    spare, taken from the steps where every core trains (benchmarks/recovery.py weighs the two).
    `faults.standby: false` turns it off. With Ray Train's controller run by the driver (the
    default) there is no controller process to start, and nothing is prepared: the standby acts
    only where the controller is an actor (a Ray Client driver, `PETATRAIN_CONTROLLER=actor`).
    """

    def __init__(self, build: Callable[[int, int], Any], *, enabled: bool = True):
        self._build, self.enabled = build, enabled
        self._lock = threading.Lock()
        self._next: tuple[int, int, Any] | None = None  # (attempt, world size, prepared trainer)

    def prepare(self, attempt: int, world: int) -> None:
        """Called once `attempt` (on `world` workers) trains: start attempt + 1's controller."""
        with self._lock:
            self._discard()
            if not self.enabled:
                return
            trainer = self._build(attempt + 1, world)
            # The stock TorchTrainer (Ray's internals moved) starts on fit(); a driver's controller has no process.
            if hasattr(trainer, "prepare") and trainer.prepare():
                self._next = (attempt + 1, world, trainer)

    def take(self, attempt: int, world: int) -> Any:
        """The prepared trainer for this attempt and world size, or None (a fresh one is needed)."""
        with self._lock:
            if self._next is not None and self._next[:2] == (attempt, world):
                trainer, self._next = self._next[2], None
                return trainer
            self._discard()
            return None

    def discard(self) -> None:
        with self._lock:
            self._discard()

    def _discard(self) -> None:
        if self._next is not None:
            self._next[2].discard()
            self._next = None
