"""A run's set-up, before its first attempt: the run directory's lease and the run it holds, the
config pinned to one dataset version, Ray, the run directory's start and the run hub."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from petatrain import constants
from petatrain.config import JobConfig
from petatrain.runtime import cluster, preflight
from petatrain.runtime.failures import Failure, FailureCause
from petatrain.runtime.hub.handle import HubHandle
from petatrain.runtime.hub.handle import start as start_hub_actor
from petatrain.runtime.job import RunResult, TrainJob
from petatrain.storage import join
from petatrain.storage.fs import atomic_write, is_local, resolve
from petatrain.storage.lock import DEFAULT_TTL_S

log = logging.getLogger(__name__)

# A driver continuing a run waits this long for the lease of the driver before it: a dead
# driver's lease expires within its TTL (storage.lock.DEFAULT_TTL_S); a live one keeps it.
RESUME_LEASE_WAIT_S = DEFAULT_TTL_S + 15


@dataclass(kw_only=True, slots=True)
class Run:
    """A run the set-up made ready to supervise."""

    job: TrainJob
    cfg: JobConfig  # checked, its dataset pinned to a version
    url: str  # the run directory (an absolute path where local)
    lease: Any  # run_dir.Lease, held: `check()` before each attempt
    prior: Any  # run_dir.PriorRun: the run the directory holds, which this one continues; None if new
    run_id: str

    @property
    def ended_ok(self) -> Any:
        """The prior run, where it ended ok and this continues it: its record (config.yaml, ledger)
        stays as it was until the continuation trains a step. None otherwise."""
        prior = self.prior
        return prior if prior is not None and prior.ended == "ok" and self.job.branch is None else None

    @property
    def carry_step(self) -> int | None:
        """The step whose checkpoint's loader position is carried onto this run's dataset version
        (`train --continue`, and every recovery of such a run); None for any other run."""
        branch = self.job.branch
        if branch is not None:
            return branch.step if branch.carry else None
        return self.prior.carry_step if self.prior is not None else None


def claim(job: TrainJob, held: contextlib.ExitStack) -> Run | RunResult:
    """The run directory's lease (on `held`), the run it holds and the checked, pinned config; the
    prior run's result instead where it trained to its end already."""
    from petatrain.train import run_dir

    if job.options is None:
        job.options = job.config.storage.options()
    cfg = preflight.checked(job.config, job.options)
    url = os.path.abspath(resolve(job.run_url)[1]) if is_local(job.run_url) else job.run_url
    # Before anything is written there: someone else's folder, or a run another driver holds, is refused.
    # A continuing driver first waits out the lease of a previous driver that died (it stops renewing).
    lease = held.enter_context(run_dir.held(url, job.options, wait_s=RESUME_LEASE_WAIT_S if job.resume else 0))
    prior = run_dir.prior_run(url, job.options)
    if prior is not None and job.resume and job.branch is not None and _same_continuation(prior, job.branch):
        # A retry of `train --continue` (an orchestrator's, or a person's): the run it started goes
        # on (or, finished, is returned as it ended); it is not started again from the source.
        log.info("%s is the continuation of %s: resumed, not started again", prior.describe(), job.branch.label)
        job.branch = None
    cfg = preflight.pinned(cfg, prior, job.options)
    if job.branch is not None and job.branch.carry:
        job.branch = dataclasses.replace(job.branch, carried=preflight.may_carry(job.branch, cfg, job.options))
    if prior is not None:
        preflight.may_continue(prior, cfg, url, job.resume, job.branch.may_change if job.branch else ())
        if job.branch is None:
            preflight.reads_its_dataset(cfg, url, job.options, carry_step=prior.carry_step)
        finished = prior.ended == "ok" and prior.step >= cfg.train.steps and preflight.has_final(url, job.options)
        if finished and job.branch is None:
            log.info("%s already trained to step %d: nothing to do", prior.describe(), prior.step)
            return _finished(prior, url)
    run_id = prior.run_id if prior else uuid.uuid4().hex[:8]
    preflight.says_if_nothing_is_held_out(cfg, job.options)
    return Run(job=job, cfg=cfg, url=url, lease=lease, prior=prior, run_id=run_id)


def start_ray(run: Run) -> None:
    """Start or join Ray, and remove the placement groups a dead driver of the run left behind."""
    constants.set_train_defaults()  # propagated to the controller and workers
    cluster.init_ray(run.job.address or run.cfg.resources.address, run.job.local_cpus, run.cfg.resources.tls)
    if run.prior is not None:  # a driver that died left its attempt's workers' reservation behind
        cluster.remove_placement_groups(run.prior.placement_groups, f"of {run.prior.describe()}: its driver is gone")


def start_run_dir(run: Run) -> None:
    """The run's config.yaml (a run that ended ok keeps its own until its continuation trains a step),
    and a branch's starting checkpoint."""
    if run.ended_ok is None:
        write_config(run)
    branch = run.job.branch
    if branch is not None:
        from petatrain.train.checkpoint.branch import adopt

        adopt(branch.source, branch.step, run.url, run.job.options)
        log.info("branch: from %s at step %d", branch.label, branch.step)


def write_config(run: Run) -> None:
    atomic_write(join(run.url, "config.yaml"), run.cfg.to_yaml().encode(), run.job.options)


def start_hub(run: Run) -> HubHandle:
    """The run hub, and a search's evaluation gate connected to it."""
    prior = run.prior
    hub = start_hub_actor(
        run.url,
        run.run_id,
        run.cfg,
        run.job.worker_options(),
        fired=prior.fired if prior else [],
        hold_until_a_step=run.ended_ok is not None,
    )
    if run.job.gate is not None:
        run.job.gate.connect(hub.actor)
    return hub


def _same_continuation(prior: Any, branch: Any) -> bool:
    """The run holds the continuation `branch` would start: from the same checkpoint, carried over."""
    source = prior.source or {}
    return bool(
        branch.carry and source.get("carry") and (source.get("from"), source.get("step")) == (branch.label, branch.step)
    )


def _finished(prior: Any, run_url: str) -> RunResult:
    failures = []
    for f in prior.failures:
        try:
            cause = FailureCause(f.cause)
        except ValueError:
            cause = FailureCause.UNKNOWN
        failures.append(Failure(cause, f.detail, f.rank))
    return RunResult(
        run=run_url, final=join(run_url, "final", "model.safetensors"), steps=prior.step,
        attempts=prior.next_attempt, failures=failures, wall_s=0.0,
    )  # fmt: skip
