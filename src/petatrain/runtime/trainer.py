"""One attempt as Ray Train runs it: the TorchTrainer of N workers, fit().

The trainer's class and the workers' runtime environment (spares, the fork server) are start-up
speed-ups (runtime.startup).
"""

from __future__ import annotations

import os
from typing import Any

from petatrain import constants
from petatrain.config import JobConfig
from petatrain.runtime import cluster
from petatrain.runtime.startup import forkserver, spares
from petatrain.runtime.startup.lean import trainer_class
from petatrain.runtime.supervisor import use_gpu
from petatrain.runtime.watchdog import Watchdog


def make_trainer(
    cfg: JobConfig, payload: Any, world: int, run_id: str, attempt: int, *, local: bool, client: bool = False
) -> Any:
    """The TorchTrainer of one attempt: N workers, gloo or NCCL, no retries of its own.

    `local`: on a Ray this process started (no autoscaler, no Ray Client). `client`: through Ray Client.
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
            worker_runtime_env=worker_runtime_env(cfg, local=local, client=client),
        ),
    )
    trainer.drain = (payload.hub, attempt)  # a failure lets rank 0 finish its checkpoint write (CommitDrain)
    return trainer


def worker_runtime_env(cfg: JobConfig, *, local: bool, client: bool = False) -> dict | None:
    """The worker group's runtime environment: the spares' (even when this run makes none, no restarts
    allowed: its ranks then start in spares another run of the job left, a search's trials, a loop's
    cycles), and the fork server's executable: as it is on a Ray this process started (its paths are
    the nodes'), guarded on a cluster it joined, none through Ray Client (`client`: paths of its own)."""
    fork = cfg.faults.forkserver and not client and forkserver.available()
    if not (cfg.faults.spares or fork):
        return None
    env = spares.worker_runtime_env(cfg.resources.cpus_per_worker, hook=cfg.faults.spares)
    return env | ({"py_executable": forkserver.py_executable(guarded=not local)} if fork else {})


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
