"""One trial of a search: a petatrain training run in `OUT/trials/<trial id>/`, driven from inside
Ray Tune's trial actor, that reports to Tune at each evaluation.

The run is a normal run (its own ledger, checkpoints, report) with the fault tolerance of
`train`: a worker that dies inside a trial is recovered by the run's own supervisor, so Tune
sees no failure. The driver runs on a thread of the trial actor; this function follows the
run's ledger and hands each evaluation to `tune.report`. If the trial actor dies (its node is
lost, or Tune stops and restarts it), Tune calls this function again and the run continues
from its newest committed checkpoint (`train --resume`).

Population-based training: each report then carries the run's checkpoint of the evaluated
step, copied into a folder laid out as a run (`checkpoints/step-S/...`) with a record naming
the trial. When PBT exploits, Tune restarts the receiving trial with the donor's checkpoint
and mutated hyperparameters: the run branches from it (`runtime.driver.Branch`): weights,
optimizer, loader position and RNG, the whole state, and its ledger records which trial and
step it continued from.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from petatrain.config import JobConfig
from petatrain.observe import events as ev
from petatrain.observe.ledger import LedgerFollower
from petatrain.storage import StorageOptions, join
from petatrain.train.checkpoint.branch import copy_checkpoint
from petatrain.tune.space import apply

log = logging.getLogger(__name__)

RECORD = "petatrain-trial.json"  # in a checkpoint reported to Tune: {"trial", "step", "run"}
TRIALS = "trials"  # OUT/trials/<trial id>/ holds each trial's run


@dataclass(frozen=True, slots=True)
class TrialSetup:
    """What every trial of a search shares (handed to the trial actors through Ray's object store,
    never written to disk: the config may hold credentials)."""

    base: JobConfig
    out: str  # the search's folder
    keys: tuple[str, ...]  # the fields searched
    steps: int  # train.steps of every trial
    checkpoints: bool  # report the evaluated step's checkpoint (pbt)
    injections: tuple[str, ...] = ()
    options: StorageOptions = field(default_factory=StorageOptions)
    # False: each trial caches the dataset's shards in a folder of its own (what each trial of a
    # plain Tune search does; benchmarks/tune.py compares); True: the node's cache, shared.
    shared_cache: bool = True


def configure(setup: TrialSetup, params: dict[str, Any]) -> JobConfig:
    """The trial's job config: the base with the sampled parameters (integers rounded where the
    field is one: PBT perturbs by multiplying), its step count, and under PBT a checkpoint at
    every evaluation (the state an exploit copies)."""
    cfg = apply(setup.base, {k: _typed(setup.base, k, v) for k, v in params.items()})
    train = replace(cfg.train, steps=setup.steps)
    checkpoint = cfg.checkpoint
    if setup.checkpoints:
        every = train.eval_every or setup.steps
        checkpoint = replace(checkpoint, every=str(every), keep_last=max(checkpoint.keep_last, 3))
    return replace(cfg, train=train, checkpoint=checkpoint)


def _typed(base: JobConfig, key: str, value: Any) -> Any:
    current: Any = base
    for part in key.split("."):
        current = getattr(current, part)
    if isinstance(current, int) and not isinstance(current, bool) and isinstance(value, float):
        return round(value)
    return value


def trial_dir(out: str, trial_id: str) -> str:
    return join(out, TRIALS, trial_id)


def run_trial(params: dict[str, Any], setup: TrialSetup) -> None:
    """Tune's function trainable: train this trial's run, reporting each evaluation."""
    from ray import tune

    from petatrain.chaos.inject import parse
    from petatrain.runtime.driver import EvalGate, TrainJob

    entered = time.time()
    trial_id = tune.get_context().get_trial_id()
    cfg = configure(setup, params)
    if not setup.shared_cache:
        own = os.path.join(tempfile.gettempdir(), f"petatrain-cache-{trial_id}")
        cfg = replace(cfg, data=replace(cfg.data, cache_dir=own))
    run_url = trial_dir(setup.out, trial_id)
    with tempfile.TemporaryDirectory(prefix="petatrain-trial-") as scratch:
        restored = tune.get_checkpoint()
        job = TrainJob(
            config=cfg,
            run_url=run_url,
            options=setup.options,
            injections=[parse(s) for s in setup.injections],
            resume=True,  # a trial started again (its actor lost, a search resumed) continues its run
            branch=_exploited(restored, trial_id, setup, scratch) if restored else None,
            gate=EvalGate(),  # the run waits at each evaluation until Tune has taken it
        )
        _Reporter(job, setup, trial_id, scratch, entered).run()


def _exploited(restored: Any, trial_id: str, setup: TrialSetup, scratch: str) -> Any:
    """The branch to take when Tune restores this trial from another trial's checkpoint (PBT's
    exploit); None when the checkpoint is the trial's own (its run holds that state already)."""
    from petatrain.runtime.driver import Branch

    folder = restored.to_directory(os.path.join(scratch, "restored"))
    with open(os.path.join(folder, RECORD), encoding="utf-8") as handle:
        record = json.load(handle)
    if record["trial"] == trial_id:
        return None
    may_change = (*setup.keys, "train.steps", "checkpoint")
    return Branch(source=folder, step=int(record["step"]), label=f"trial {record['trial']}", may_change=may_change)


class _Reporter:
    """Runs the trial's driver on a thread and reports the run's evaluations to Tune, in order."""

    def __init__(self, job: Any, setup: TrialSetup, trial_id: str, scratch: str, entered: float):
        self.job, self.setup, self.trial_id, self.scratch = job, setup, trial_id, scratch
        self.entered = entered  # when Tune called the trial: its start-up runs to the first step
        self.startup_s: float | None = None
        self.events: queue.Queue[ev.Event | None] = queue.Queue()
        self.error: BaseException | None = None
        self.loss: float | None = None  # of the newest step
        self.committed: set[int] = set()
        self.pending: dict[str, Any] | None = None  # an evaluation waiting for its step's checkpoint
        self.reported: set[int] = set()  # steps whose evaluation Tune has (an attempt after a fault repeats some)
        # The last step's evaluation goes to Tune once the run has ended: a scheduler stops a trial that
        # reached train.steps (ASHA's max_t), and the stop would cut the run's end (final weights, ledger).
        self.last: dict[str, Any] | None = None

    def run(self) -> None:
        follower = LedgerFollower(self.job.run_url, self.job.options, self.events.put)
        driver = threading.Thread(target=self._drive, args=(follower,), name="petatrain-trial-driver", daemon=True)
        driver.start()
        while (event := self.events.get()) is not None:
            self._take(event)
        if self.pending is not None:
            self._report(self.pending, checkpoint=False)
        driver.join()
        if self.error is not None:
            raise self.error
        if self.last is not None:
            checkpoint = self.setup.checkpoints and self.last["step"] in self.committed
            self._hand_over(self.last, checkpoint=checkpoint)

    def _drive(self, follower: LedgerFollower) -> None:
        from petatrain.runtime.driver import run

        try:
            run(self.job)
        except BaseException as exc:  # handed to the trial's thread: Tune records it and may retry
            self.error = exc
        finally:
            follower.stop()
            self.events.put(None)

    def _take(self, event: ev.Event) -> None:
        if isinstance(event, ev.Step) and self.startup_s is None:
            self.startup_s = event.t - self.entered
        if isinstance(event, ev.Step) and event.loss is not None:
            self.loss = event.loss
        elif isinstance(event, ev.CheckpointCommit):
            self.committed.add(event.step)
            if self.pending is not None and self.pending["step"] == event.step:
                self._report(self.pending, checkpoint=True)
                self.pending = None
        elif isinstance(event, ev.Eval):
            if self.pending is not None:  # its checkpoint never came (a retention race, a fault)
                self._report(self.pending, checkpoint=False)
                self.pending = None
            step = event.step
            metrics = {
                "eval_loss": event.loss,
                "train_loss": self.loss,
                "step": step,
                "startup_s": self.startup_s,  # trial called -> its run's first step done
            }
            if step in self.reported:
                self.job.gate.release(step)
            elif step >= self.setup.steps:
                self.last = metrics
                self.job.gate.release(step)
            elif self.setup.checkpoints and step not in self.committed:
                self.pending = metrics
            else:
                self._report(metrics, checkpoint=self.setup.checkpoints)

    def _report(self, metrics: dict[str, Any], *, checkpoint: bool) -> None:
        """Hand the evaluation to Tune (it returns once Tune took it, or raises SystemExit when Tune
        stops the trial), then let the run go on."""
        self._hand_over(metrics, checkpoint=checkpoint)
        self.reported.add(metrics["step"])
        self.job.gate.release(metrics["step"])

    def _hand_over(self, metrics: dict[str, Any], *, checkpoint: bool) -> None:
        from ray import tune

        if not checkpoint:
            tune.report(metrics)
            return
        step = metrics["step"]
        folder = os.path.join(self.scratch, f"report-{step}")
        try:
            copy_checkpoint(self.job.run_url, step, folder, self.job.options)
        except (FileNotFoundError, OSError) as exc:  # retention removed it meanwhile
            log.warning("trial %s: checkpoint of step %d not reported: %s", self.trial_id, step, exc)
            tune.report(metrics)
            return
        record = {"trial": self.trial_id, "step": step, "run": self.job.run_url}
        with open(os.path.join(folder, RECORD), "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        try:
            # Tune persists the folder into its storage before report returns.
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
