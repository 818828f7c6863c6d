"""`run(TrainJob) -> RunResult`: a training run on Ray, recovering from every fault.

The driver prepares the run (config checks, the run directory's lease, Ray, the run hub),
then hands the attempts to the `Supervisor` (runtime/supervisor.py): each attempt runs the
worker loop on N workers with Ray Train's TorchTrainer (N chosen from `parallel.workers` and
what the cluster has alive, so a lost node shrinks the next attempt), a watchdog thread reads
the step heartbeats and kills a hung worker group after `faults.hang_timeout_s`, and every
failure is classified, written to the ledger and answered by the restart policy: retry from
the newest verified checkpoint, or give up after `faults.max_restarts`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from petatrain import constants
from petatrain.chaos.inject import Injection
from petatrain.config import JobConfig
from petatrain.errors import ConfigError, PetatrainError
from petatrain.runtime import cluster
from petatrain.runtime.failures import CAUSES, AttemptFailed, Failure, FailureCause
from petatrain.runtime.supervisor import AttemptOutcome, RestartPolicy, Supervisor, WorldSizePolicy
from petatrain.runtime.trainer import Standby, fit, make_trainer
from petatrain.runtime.watchdog import Watchdog
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, is_local, resolve
from petatrain.storage.lock import DEFAULT_TTL_S

log = logging.getLogger(__name__)

# A driver continuing a run waits this long for the lease of the driver before it: a dead
# driver's lease expires within its TTL (storage.lock.DEFAULT_TTL_S); a live one keeps it.
RESUME_LEASE_WAIT_S = DEFAULT_TTL_S + 15


@dataclass(kw_only=True, slots=True)
class TrainJob:
    config: JobConfig
    run_url: str
    options: StorageOptions | None = None  # None: the config's `storage` section
    address: str = ""
    injections: list[Injection] = field(default_factory=list)
    on_event: Callable[[dict[str, Any]], None] | None = None  # progress for the CLI
    local_cpus: int = 0
    stop_after_s: float | None = None  # end the run (checkpointed, final weights) this long after it started
    # Continue the run the run directory holds (a RayJob retry, a lost head pod, a new cluster):
    # same run id, the next attempt number, from its newest committed checkpoint. Without it, a
    # run directory that holds a run is refused.
    resume: bool = False
    # Start from another run's checkpoint instead (`train --from`, PBT's exploit in petatrain.tune).
    branch: Branch | None = None
    # Hold the run after each evaluation until the gate releases it (a search's trial, petatrain.tune).
    gate: EvalGate | None = None


class EvalGate:
    """The run waits after each evaluation until `release(step)`: a search's trial lets it go on
    once Tune has taken the evaluation, so the run never trains past a decision it has not had
    (ASHA stopping it, PBT replacing its state)."""

    def __init__(self) -> None:
        self._hub: Any = None
        self._connected = threading.Event()

    def connect(self, hub: Any) -> None:
        self._hub = hub
        self._connected.set()

    def release(self, step: int) -> None:
        self._connected.wait()
        self._hub.release.remote(step)


@dataclass(frozen=True, slots=True)
class Branch:
    """Continue from checkpoint `step` of `source` (a run, or a folder laid out as one): its weights,
    optimizer, loader position and RNG, with this job's config. `label` names the source in the
    ledger ("trial 3f2a_00001", "RUN@STEP"). With `resume`, the run directory may hold a run
    already (a trial that exploits another): `may_change` are the config fields (dotted, or a
    section) that may then differ from that run's, besides what a resume may change."""

    source: str
    step: int
    label: str
    may_change: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.label, "step": self.step}


@dataclass(kw_only=True, slots=True)
class RunResult:
    """How a run ended (also in its ledger): the run, its final weights, the step reached, the faults."""

    run: str
    final: str
    steps: int
    attempts: int
    failures: list[Failure]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "final": self.final,
            "steps": self.steps,
            "attempts": self.attempts,
            "failures": [f.to_dict() for f in self.failures],
            "wall_s": self.wall_s,
        }

    def __getitem__(self, key: str) -> Any:
        """`result["steps"]`, for callers written when run() returned the dict."""
        return self.to_dict()[key]


def run(job: TrainJob) -> RunResult:
    """Train to `train.steps`, recovering from faults; returns a summary (also in the ledger)."""
    with contextlib.ExitStack() as held:  # the run directory's lease, let go however the run ends
        return _drive(job, held)


def _drive(job: TrainJob, held: contextlib.ExitStack) -> RunResult:
    from petatrain.train import run_dir

    if job.options is None:
        job.options = job.config.storage.options()
    cfg = _checked(job.config, job.options)
    run_url = job.run_url
    if is_local(run_url):
        run_url = os.path.abspath(resolve(run_url)[1])
    # Before anything is written there: someone else's folder, or a run another driver holds, is refused.
    # A continuing driver first waits out the lease of a previous driver that died (it stops renewing).
    lease = held.enter_context(run_dir.held(run_url, job.options, wait_s=RESUME_LEASE_WAIT_S if job.resume else 0))
    prior = run_dir.prior_run(run_url, job.options)
    cfg = _pinned(cfg, prior, job.options)
    if prior is not None:
        _may_continue(prior, cfg, run_url, job.resume, job.branch.may_change if job.branch else ())
        if job.branch is None:
            _reads_its_dataset(cfg, run_url, job.options)
        finished = prior.ended == "ok" and prior.step >= cfg.train.steps and _has_final(run_url, job.options)
        if finished and job.branch is None:
            log.info("%s already trained to step %d: nothing to do", prior.describe(), prior.step)
            return _finished(prior, run_url)
    constants.set_train_defaults()  # propagated to the controller and workers
    cluster.init_ray(job.address or cfg.resources.address, job.local_cpus, cfg.resources.tls)
    if prior is not None:  # a driver that died left its attempt's workers' reservation behind
        cluster.remove_placement_groups(prior.placement_groups, f"of {prior.describe()}: its driver is gone")
    # A run that ended ok keeps its record (config.yaml, ledger) until its continuation trains a step.
    ended_ok = prior if prior is not None and prior.ended == "ok" and job.branch is None else None
    if ended_ok is None:
        atomic_write(join(run_url, "config.yaml"), cfg.to_yaml().encode(), job.options)
    if job.branch is not None:
        from petatrain.train.checkpoint.branch import adopt

        adopt(job.branch.source, job.branch.step, run_url, job.options)
        log.info("branch: from %s at step %d", job.branch.label, job.branch.step)
    run_id = prior.run_id if prior else uuid.uuid4().hex[:8]
    hub = _start_hub(
        run_url,
        run_id,
        cfg,
        job.options,
        fired=prior.fired if prior else [],
        hold_until_a_step=ended_ok is not None,
    )
    if job.gate is not None:
        job.gate.connect(hub.actor)
    policy, alive = WorldSizePolicy(cfg), cluster.RayCluster()
    attempts = RayAttempts(job, cfg, run_url, run_id, hub, grow=lambda world: policy.larger(world, *alive.resources()))
    try:
        started = attempts.started
        lo, hi = cfg.parallel.worker_range()
        metrics = hub.call("metrics_url")
        _publish_targets(run_url, run_id, metrics, job.options)
        if metrics:
            log.info("metrics: %s", metrics)
        health = _health_server(hub, cfg)
        if health is not None:
            held.callback(health.close)
            log.info("health: %s/livez, %s/readyz", health.url, health.url)
        health_url = health.url if health is not None else ""
        source = job.branch.to_dict() if job.branch else None
        if prior is None:
            attempts.emit(
                "run_start", run_id=run_id, workers=[lo, hi], steps=cfg.train.steps, metrics=metrics,
                config=cfg.to_dict(), t=started, health=health_url, source=source,
            )  # fmt: skip
        else:
            _continue(prior, attempts, cfg, metrics, health_url, source)
        supervisor = Supervisor(
            attempts=attempts,
            cluster=alive,
            restart=RestartPolicy(cfg.faults.max_restarts),
            world_size=policy,
            emit=attempts.emit,
            # A driver that stalled past its lease must not start writing beside the new holder.
            before_attempt=lease.check,
            attempt=prior.next_attempt if prior else 0,
            capacity_wait_s=0.0 if attempts.local else cfg.faults.capacity_wait_s,
        )
        failures = supervisor.run()
        final = join(run_url, "final", "model.safetensors")
        reached = max((b["step"] for b in hub.call("heartbeats").values()), default=cfg.train.steps)
        if reached < 0:  # the attempt resumed where the run ends: it trained no step
            reached = job.branch.step if job.branch else prior.step if prior else cfg.train.steps
        detail = "" if reached >= cfg.train.steps else f"stopped at step {reached}: the time limit was reached"
        attempts.emit("end", status="ok", step=reached, detail=detail, final=final)
        wall = time.time() - started
        return RunResult(
            run=run_url, final=final, steps=reached, attempts=supervisor.attempt + 1, failures=failures, wall_s=wall
        )
    finally:
        try:
            if attempts.ended:
                _last_scrape(hub, cfg.observe.metrics_linger_s)
            if ended_ok is not None and _started(hub):
                atomic_write(join(run_url, "config.yaml"), cfg.to_yaml().encode(), job.options)
            elif ended_ok is not None:
                log.warning(
                    "%s is left as it was: its continuation ended before it trained a step", ended_ok.describe()
                )
        finally:
            _publish_targets(run_url, run_id, None, job.options)  # the endpoint goes away with the hub
            attempts.close()
            hub.close()


def _started(hub: HubHandle) -> bool:
    try:
        return bool(hub.call("started", timeout=30))
    except Exception:  # a hub that does not answer: its events were not all written; keep the old config
        return False


def _publish_targets(run_url: str, run_id: str, metrics: str | None, options: StorageOptions | None) -> None:
    """Write the metrics endpoint into `RUN/prometheus/targets.json`, the file Prometheus'
    `file_sd_configs` reads (labels run_id, run_dir); with no endpoint, remove it."""
    from petatrain.observe.metrics import TARGETS_FILE, file_sd_targets

    url = join(run_url, TARGETS_FILE)
    try:
        if metrics:
            atomic_write(url, file_sd_targets(metrics, {"run_id": run_id, "run_dir": run_url}), options)
            return
        fs, path = resolve(url, options)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)
    except Exception as exc:  # discovery is a convenience: the run and its ledger do not depend on it
        log.warning("could not %s %s: %s", "write" if metrics else "remove", url, exc)


def _last_scrape(hub: HubHandle, linger_s: float) -> None:
    """Keep the ended run's metrics up until Prometheus has scraped them once more (if it scrapes
    them at all), at most `linger_s`: else the final goodput dies with the run, unseen."""
    if linger_s <= 0:
        return
    try:
        hub.call("last_scrape", linger_s, timeout=linger_s + 10)
    except KeyboardInterrupt:  # the run is over; a person who stops the wait loses only that scrape
        log.info("stopped waiting for the metrics' last scrape")
    except Exception:
        log.debug("waiting for the metrics' last scrape failed", exc_info=True)


def _may_continue(prior: Any, cfg: JobConfig, run_url: str, resume: bool, may_change: tuple[str, ...]) -> None:
    """A run directory holding a run is continued only when asked to, and only with the same run's
    config (but for `may_change`: the hyperparameters a search's exploit mutates)."""
    from petatrain.config import RESUMABLE, resume_differences

    if not resume:
        raise ConfigError(
            f"--run-dir {run_url} holds {prior.describe()}: pass --resume to continue it, or give a new --run-dir"
        )
    changed = resume_differences(prior.config, cfg, may_change)
    if changed:
        raise ConfigError(
            f"--run-dir {run_url} holds a run with another config ({'; '.join(changed)}); "
            f"on --resume only {', '.join(RESUMABLE)} may change"
        )


def _health_server(hub: HubHandle, cfg: JobConfig) -> Any:
    """The driver's /livez and /readyz (runtime.health), or None when observe.health_host is ""."""
    if not cfg.observe.health_host:
        return None
    from petatrain.runtime.health import HealthServer

    try:
        return HealthServer(hub.actor, cfg.observe.health_host, cfg.observe.health_port, cfg.observe.health_window_s)
    except OSError as exc:
        where = f"{cfg.observe.health_host}:{cfg.observe.health_port}"
        raise ConfigError(
            f"observe.health_host/health_port: cannot serve the health endpoint on {where}: {exc}"
        ) from None


def _continue(
    prior: Any, attempts: RayAttempts, cfg: JobConfig, metrics: str | None, health: str, source: dict[str, Any] | None
) -> None:
    """The ledger's record of a new driver taking the run over: the lost driver's attempt as a
    failure. A branch (`source`) abandons what that driver was doing: no failure, and the config
    the run goes on with is recorded (its hyperparameters may differ from the run's start)."""
    attempts.emit(
        "run_continue", run_id=prior.run_id, attempt=prior.next_attempt, previous=prior.ended or "interrupted",
        steps=cfg.train.steps, metrics=metrics or "", health=health, source=source,
        config=cfg.to_dict() if source else None,
    )  # fmt: skip
    if not prior.ended and source is None:
        attempts.emit(
            "failure", attempt=prior.next_attempt - 1, cause=FailureCause.DRIVER_LOST.value, rank=None,
            detail=f"the driver stopped at step {prior.step} without ending the run; a new driver continues it",
        )  # fmt: skip
        attempts.emit("restart", attempt=prior.next_attempt, reason=FailureCause.DRIVER_LOST.value)


def _reads_its_dataset(cfg: JobConfig, run_url: str, options: StorageOptions | None) -> None:
    """A continuing run resumes its newest checkpoint's loader position: refuse (one line, before
    anything starts) a dataset that is not the one that position counts in."""
    from petatrain.data import index
    from petatrain.train.batches import held_out
    from petatrain.train.checkpoint import latest_verified

    state = latest_verified(run_url, options)
    loader = state.loader if state is not None else None
    if state is None or not isinstance(loader, dict):
        return
    try:
        dataset = index.open_dataset(cfg.data.dataset, options)
    except PetatrainError:
        return  # the loader says what is wrong with it, as it does for a new run
    version = loader.get("dataset_version")
    rows = dataset.shards.column("rows").to_pylist()
    samples = sum(rows[: len(rows) - held_out(cfg, len(rows))])
    if version not in (None, dataset.manifest.generation) or loader.get("num_samples") not in (None, samples):
        trained = f"version {version}" if version is not None else f"{loader.get('num_samples')} samples"
        raise PetatrainError(
            f"--run-dir {run_url}: its checkpoint of step {state.step} is a position in {trained} of "
            f"{index.split_version(cfg.data.dataset)[0]}; data.dataset {cfg.data.dataset} gives version "
            f"{dataset.manifest.generation} ({samples} samples): a run resumes on the data it trained on"
        )


def _has_final(run_url: str, options: StorageOptions | None) -> bool:
    """The run's final weights are committed (a run whose ledger ended but whose final/ is gone is not done)."""
    from petatrain.storage.fs import exists
    from petatrain.train.checkpoint.final import RECORD, final_dir

    return exists(join(final_dir(run_url), RECORD), options)


def _finished(prior: Any, run_url: str) -> RunResult:
    failures = []
    for f in prior.failures:
        try:
            cause = FailureCause(f.get("cause"))
        except ValueError:
            cause = FailureCause.UNKNOWN
        failures.append(Failure(cause, str(f.get("detail") or ""), f.get("rank")))
    return RunResult(
        run=run_url, final=join(run_url, "final", "model.safetensors"), steps=prior.step,
        attempts=prior.next_attempt, failures=failures, wall_s=0.0,
    )  # fmt: skip


def _pinned(cfg: JobConfig, prior: Any, options: StorageOptions | None) -> JobConfig:
    """The config with data.dataset pinned to one version of the dataset (`DATASET@vN`), so that
    an append while the run trains never changes what its recoveries read: a new run takes the
    latest version; a continuing run the version it trained on, as its ledger records it (a run
    recorded before runs were pinned goes on unpinned)."""
    from petatrain.data import index

    root, version = index.split_version(cfg.data.dataset)
    if version is not None:
        return cfg
    recorded = (prior.config.get("data") or {}).get("dataset") if prior is not None else None
    if isinstance(recorded, str) and index.split_version(recorded)[0] == root:
        pinned = recorded
    else:
        manifest = index.read_manifest(root, options)
        if manifest is None:
            return cfg  # `_checked` said so already, unless the dataset went away since
        pinned = index.versioned(root, manifest.generation)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=pinned))


def _checked(cfg: JobConfig, options: StorageOptions | None) -> JobConfig:
    """The config as the workers get it; what would fail only after Ray started fails here."""
    from petatrain.data import index
    from petatrain.errors import CorruptDataError
    from petatrain.storage.fs import exists
    from petatrain.train import strategies

    strategies.get(cfg.parallel.strategy).check_config(cfg)
    if is_local(cfg.data.dataset):  # Ray workers do not share the driver's working directory
        dataset = os.path.abspath(resolve(cfg.data.dataset)[1])
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=dataset))
    if not exists(join(index.split_version(cfg.data.dataset)[0], index.MANIFEST), options):
        raise PetatrainError(
            f"no dataset at {cfg.data.dataset} (data.dataset); `petatrain demo` builds the demo dataset, "
            "`petatrain ingest SOURCES --out URL --tokenizer bytes --pack-length N` builds yours"
        )
    try:
        manifest = index.read_manifest(cfg.data.dataset, options)
    except CorruptDataError:  # a damaged manifest is the loader's to report, on the worker, as always
        manifest = None
    keys = index.dataset_keys(cfg.data.dataset, manifest, options) if manifest else None
    if keys is not None:
        keys.check()  # a missing or wrong keyring: one line here, not a fault on every worker
    if manifest is not None:
        from petatrain.train.batches import check_dataset

        check_dataset(cfg, cfg.data.dataset, manifest)  # not three faults on the workers, 20 s later
    constants.controller_mode()  # a bad PETATRAIN_CONTROLLER fails here, before anything starts
    return cfg


class HubHandle:
    """The driver's side of the run hub actor."""

    def __init__(self, actor: Any):
        self.actor = actor

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def close(self) -> None:
        import ray

        try:
            self.call("close")
            ray.kill(self.actor)
        except Exception:  # the ledger was flushed on every event; closing is best effort
            log.debug("hub close failed", exc_info=True)


def _start_hub(
    run_url: str,
    run_id: str,
    cfg: JobConfig,
    options: StorageOptions | None,
    fired: list[str],
    hold_until_a_step: bool = False,
) -> HubHandle:
    """The run hub, on the driver's node: its metrics endpoint is on this machine's 127.0.0.1.
    `fired`: injected faults that fired under an earlier driver of the run (none fires again).
    `hold_until_a_step`: the ledger is held until the run trains a step (a finished run's continuation)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from petatrain.runtime.hub import RunHub

    # mypy keeps a decorated class's own type: it cannot see that @ray.remote made RunHub an actor class.
    actor = RunHub.options(  # type: ignore[attr-defined]
        # Unique per driver: a lost driver's hub may still be going away when the next one starts.
        name=f"petatrain-hub-{run_id}-{uuid.uuid4().hex[:6]}",
        scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.this_node(), soft=False),
    ).remote(
        run_url, _for_workers(options), cfg.observe.metrics_host, cfg.observe.metrics_port, fired, hold_until_a_step
    )
    return HubHandle(actor)


def _for_workers(options: StorageOptions | None) -> StorageOptions:
    """Options for Ray processes: they may have started before the driver's AWS_* variables were set."""
    return (options or StorageOptions()).for_workers()


class RayAttempts:
    """The supervisor's attempts on Ray (runtime.supervisor.Attempts): standby, watchdog, TorchTrainer."""

    def __init__(
        self,
        job: TrainJob,
        cfg: JobConfig,
        run_url: str,
        run_id: str,
        hub: HubHandle,
        grow: Callable[[int], int | None] | None = None,
    ):
        self.job, self.cfg, self.run_url, self.run_id, self.hub = job, cfg, run_url, run_id, hub
        self.started = time.time()
        self.ended = False  # the ledger has the run's end (finished or given up)
        self.local = not (job.address or cfg.resources.address or os.environ.get(constants.RAY_ADDRESS_ENV))
        self.standby = Standby(self.build, enabled=cfg.faults.standby)
        self.watch = Watchdog(hub.actor, cfg.faults.hang_timeout_s, on_training=self.standby.prepare, grow=grow)
        from petatrain.train.loop import NonFiniteLoss

        self.causes = {**CAUSES, NonFiniteLoss: FailureCause.NONFINITE}

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = self.hub.call("emit", event, fields)
        self.ended = self.ended or event == "end"
        if self.job.on_event:
            self.job.on_event(record)
        return record

    def build(self, attempt: int, world: int) -> Any:
        return make_trainer(self.cfg, self._payload(attempt), world, self.run_id, attempt, local=self.local)

    def run(self, attempt: int, world: int) -> AttemptOutcome:
        from petatrain.runtime._ray.errors import attempt_failed

        trainer = self.standby.take(attempt, world)
        warm = trainer is not None
        trainer = trainer or self.build(attempt, world)
        self.hub.call("new_attempt", attempt)
        in_driver = getattr(trainer, "controller_in_driver", False)
        self.emit(
            "attempt_start", attempt=attempt, world_size=world, controller="driver" if in_driver else "actor",
            warm_controller=warm,
        )  # fmt: skip
        error = fit(trainer, attempt, world, self.watch, shared_job=self.job.gate is not None)
        if error is None:
            return AttemptOutcome()
        return AttemptOutcome(error=attempt_failed(error, self.causes), hang=self.watch.verdict)

    def rank_died(self, error: AttemptFailed) -> int | None:
        try:
            beats = self.hub.call("heartbeats", timeout=5)
        except Exception:  # a hub that does not answer: the error's own cause stands
            return None
        return cluster.died_on_its_own({(b["pid"], b["node_id"]): rank for rank, b in beats.items()})

    def close(self) -> None:
        self.watch.stop()
        self.standby.discard()

    def _payload(self, attempt: int) -> Any:
        from petatrain.train.loop import Payload

        job = self.job
        return Payload(
            config=self.cfg.to_dict(),
            run_url=self.run_url,
            options=_for_workers(job.options),
            hub=self.hub.actor,
            attempt=attempt,
            run_started=self.started,
            injections=list(job.injections),  # the workers leave out those that fired already
            stop_at=self.started + job.stop_after_s if job.stop_after_s else None,
            hold_at_eval=job.gate is not None,
        )
