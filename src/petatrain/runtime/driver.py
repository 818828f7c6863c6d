"""`run(TrainJob) -> RunResult`: a training run on Ray, recovering from every fault.

The driver sets the run up (runtime/setup.py: config checks, the run directory's lease, Ray,
the run hub; runtime/endpoints.py: metrics and health), then supervises it: it hands the
attempts to the `Supervisor` (runtime/supervisor.py). Each attempt runs the worker loop on N
workers with Ray Train's TorchTrainer (runtime/attempts.py; N chosen from `parallel.workers`
and what the cluster has alive, so a lost node shrinks the next attempt), a watchdog thread
reads the step heartbeats and kills a hung worker group after `faults.hang_timeout_s`, and
every failure is classified, written to the ledger and answered by the restart policy: retry
from the newest verified checkpoint, or give up after `faults.max_restarts`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from petatrain.config import JobConfig
from petatrain.observe import events as ev
from petatrain.runtime import cluster, setup
from petatrain.runtime.attempts import RayAttempts
from petatrain.runtime.endpoints import Endpoints, last_scrape, open_endpoints, publish_targets
from petatrain.runtime.failures import Failure, FailureCause
from petatrain.runtime.hub.handle import HubHandle
from petatrain.runtime.job import Branch, EvalGate, RunResult, TrainJob
from petatrain.runtime.supervisor import RestartPolicy, Supervisor, WorldSizePolicy
from petatrain.storage import join

__all__ = ["Branch", "EvalGate", "RunResult", "TrainJob", "run"]

log = logging.getLogger(__name__)


def run(job: TrainJob) -> RunResult:
    """Train to `train.steps`, recovering from faults; returns a summary (also in the ledger)."""
    with contextlib.ExitStack() as held:  # the run directory's lease, let go however the run ends
        ready = setup.claim(job, held)
        if isinstance(ready, RunResult):  # it trained to its end already
            return ready
        setup.start_ray(ready)
        setup.start_run_dir(ready)
        hub = setup.start_hub(ready)
        return _supervise(ready, hub, held)


def _supervise(ready: setup.Run, hub: HubHandle, held: contextlib.ExitStack) -> RunResult:
    """The attempts, from the ledger's run_start (or run_continue) to its end; the hub goes however they end."""
    cfg = ready.cfg
    policy, alive = WorldSizePolicy(cfg), cluster.RayCluster()
    try:
        attempts = RayAttempts(
            ready.job, cfg, ready.url, ready.run_id, hub, grow=lambda world: policy.larger(world, *alive.resources())
        )
        attempts.carry_step = ready.carry_step
    except BaseException:  # the hub and its metrics port go with the run that could not start
        hub.close()
        raise
    try:
        endpoints = open_endpoints(hub, cfg, ready.url, ready.run_id, ready.job.options, held)
        _announce(ready, attempts, endpoints)
        supervisor = Supervisor(
            attempts=attempts,
            cluster=alive,
            restart=RestartPolicy(cfg.faults.max_restarts),
            world_size=policy,
            emit=attempts.emit,
            # A driver that stalled past its lease must not start writing beside the new holder.
            before_attempt=ready.lease.check,
            attempt=ready.prior.next_attempt if ready.prior else 0,
            capacity_wait_s=0.0 if attempts.local else cfg.faults.capacity_wait_s,
        )
        failures = supervisor.run()
        return _finish(ready, hub, attempts, supervisor.attempt + 1, failures)
    finally:
        _close(ready, hub, attempts)


def _announce(ready: setup.Run, attempts: RayAttempts, endpoints: Endpoints) -> None:
    """This driver's first events: run_start, or run_continue for a run the directory holds."""
    cfg, source = ready.cfg, ready.job.branch.to_dict() if ready.job.branch else None
    if ready.prior is not None:
        _continue(ready.prior, attempts, cfg, endpoints.metrics, endpoints.health, source)
        return
    lo, hi = cfg.parallel.worker_range()
    attempts.emit(
        ev.RunStart(
            t=attempts.started, run_id=ready.run_id, workers=[lo, hi], steps=cfg.train.steps,
            metrics=endpoints.metrics or "", config=cfg.to_dict(), health=endpoints.health, source=source,
        )
    )  # fmt: skip


def _continue(
    prior: Any, attempts: RayAttempts, cfg: JobConfig, metrics: str | None, health: str, source: dict[str, Any] | None
) -> None:
    """The ledger's record of a new driver taking the run over: the lost driver's attempt as a
    failure. A branch (`source`) abandons what that driver was doing: no failure, and the config
    the run goes on with is recorded (its hyperparameters may differ from the run's start)."""
    attempts.emit(
        ev.RunContinue(
            run_id=prior.run_id, attempt=prior.next_attempt, previous=prior.ended or "interrupted",
            steps=cfg.train.steps, metrics=metrics or "", health=health, source=source,
            config=cfg.to_dict() if source else None,
        )
    )  # fmt: skip
    if not prior.ended and source is None:
        attempts.emit(
            ev.Failure(
                attempt=prior.next_attempt - 1, cause=FailureCause.DRIVER_LOST.value, rank=None,
                detail=f"the driver stopped at step {prior.step} without ending the run; a new driver continues it",
            )
        )  # fmt: skip
        attempts.emit(ev.Restart(attempt=prior.next_attempt, reason=FailureCause.DRIVER_LOST.value))


def _finish(ready: setup.Run, hub: HubHandle, attempts: RayAttempts, count: int, failures: list[Failure]) -> RunResult:
    """The ledger's `end` of a run that trained to its end (or its time limit), and its result."""
    cfg, final = ready.cfg, join(ready.url, "final", "model.safetensors")
    reached = max((b["step"] for b in hub.call("heartbeats").values()), default=cfg.train.steps)
    if reached < 0:  # the attempt resumed where the run ends: it trained no step
        reached = ready.job.branch.step if ready.job.branch else ready.prior.step if ready.prior else cfg.train.steps
    detail = "" if reached >= cfg.train.steps else f"stopped at step {reached}: the time limit was reached"
    attempts.emit(ev.End(status="ok", step=reached, detail=detail, final=final))
    wall = time.time() - attempts.started
    return RunResult(run=ready.url, final=final, steps=reached, attempts=count, failures=failures, wall_s=wall)


def _close(ready: setup.Run, hub: HubHandle, attempts: RayAttempts) -> None:
    """However the attempts ended: the metrics' last scrape, a finished run's continuation's
    config.yaml, then the metrics' discovery file, the watchdog, the standby and the hub go."""
    try:
        if attempts.ended:
            last_scrape(hub, ready.cfg.observe.metrics_linger_s)
        if ready.ended_ok is not None and _started(hub):
            setup.write_config(ready)
        elif ready.ended_ok is not None:
            log.warning(
                "%s is left as it was: its continuation ended before it trained a step", ready.ended_ok.describe()
            )
    finally:
        publish_targets(ready.url, ready.run_id, None, ready.job.options)  # the endpoint goes away with the hub
        attempts.close()
        hub.close()


def _started(hub: HubHandle) -> bool:
    try:
        return bool(hub.call("started", timeout=30))
    except Exception:  # a hub that does not answer: its events were not all written; keep the old config
        return False
