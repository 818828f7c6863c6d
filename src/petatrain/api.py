"""petatrain as a library: what the CLI calls, and what Tune, Serve and scripts call the same way.

Each verb takes typed arguments and returns a typed result; `to_dict()` on a result is what
`petatrain VERB --json` prints. Nothing here prints: progress reaches the caller through
callbacks (`on_stage` for ingest, `on_event` for train, every ledger event as it is written).

    ingest()  raw files -> a dataset                      -> IngestSummary
    inspect() what a dataset holds, --verify its shards   -> DatasetReport
    check_resume() the loader's exactly-once promise      -> ResumeCheck
    train()   a run, recovering from faults               -> TrainResult
    report()  a run's goodput, faults, plots              -> RunReport
    plan()    accelerators, count, strategy, cost         -> Plan
    profile() measured steps against the plan's estimate  -> ProfileReport
    sample()  text from a run's final weights             -> list[str]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from petatrain import constants
from petatrain.config import IngestConfig, JobConfig
from petatrain.data.ingest.job import IngestJob, IngestSummary
from petatrain.errors import ConfigError, CorruptDataError, GateRefused, PetatrainError
from petatrain.observe import events
from petatrain.observe.ledger import LedgerFollower
from petatrain.security.protection import Protection
from petatrain.storage import StorageOptions, join

if TYPE_CHECKING:
    from petatrain.data.synth import Corpus
    from petatrain.plan.recommend import Plan

__all__ = [
    "DatasetReport",
    "FaultRecord",
    "IngestSummary",
    "ProfileReport",
    "ResumeCheck",
    "RunReport",
    "TrainResult",
    "check_resume",
    "driver_log_path",
    "ingest",
    "inspect",
    "metrics_targets_path",
    "plan",
    "profile",
    "remove_run",
    "report",
    "sample",
    "soak_schedule",
    "synthetic_corpus",
    "train",
]

log = logging.getLogger(__name__)


# -- results --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetReport:
    """What `inspect` found. `problems` names each shard that failed `verify` (empty: none did,
    or none was checked: `verified` is None)."""

    dataset: str
    kind: str | None
    rows: int
    shards: int
    verified: bool | None
    problems: list[str]
    fields: dict[str, Any] = field(repr=False)  # everything, as `inspect --json` prints it

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetReport:
        return cls(
            dataset=d["dataset"],
            kind=d.get("kind"),
            rows=d["rows"],
            shards=d["shards"],
            verified=d["verified"],
            problems=list(d["problems"]),
            fields=d,
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeCheck:
    """Stream one epoch with `ranks_before` ranks, stop half-way, resume with `ranks_after`."""

    exactly_once: bool
    samples_in_epoch: int
    ranks_before: int
    ranks_after: int
    fields: dict[str, Any] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunReport:
    """A run's goodput report (`RUN/report.json`); `files` names report.html and the plots."""

    run: str
    status: str
    goodput: float
    wall_s: float
    files: dict[str, str]
    fields: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunReport:
        return cls(
            run=d["run"], status=d["status"], goodput=d["goodput"], wall_s=d["wall_s"], files=d["files"], fields=d
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultRecord:
    cause: str
    rank: int | None
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    """A finished run: where it is, how far it got, what it recovered from, and its report."""

    run: str
    final: str
    steps: int
    attempts: int
    failures: list[FaultRecord]
    wall_s: float
    report: RunReport
    ray_log: str | None = None  # the driver's Ray log file, when Ray's output was kept off the console
    fields: dict[str, Any] = field(repr=False, default_factory=dict)  # the run's own summary

    def to_dict(self) -> dict[str, Any]:
        return {**self.fields, "report": self.report.to_dict()}


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileReport:
    """Measured steps compared with the plan's estimate; `calibration_path` when one was saved."""

    device: str
    steps: int
    verdict: str
    calibration_path: str | None
    fields: dict[str, Any] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


# -- data -----------------------------------------------------------------------------------


def ingest(
    sources: Sequence[str],
    out: str,
    *,
    config: IngestConfig | None = None,
    append: bool = False,
    register: bool = False,
    refresh: bool = False,
    address: str = "",
    local_cpus: int = 0,
    options: StorageOptions | None = None,
    on_stage: Callable[[str, str], None] | None = None,
    on_progress: Callable[[str, Any], None] | None = None,
) -> IngestSummary:
    """Ingest `sources` into the dataset at `out` (on Ray tasks); `on_stage(stage, "start"|"done")`,
    `on_progress(stage, StageProgress)` as each piece of a stage's work finishes (not through Ray Client).

    Through Ray Client (`address="ray://..."`) the ingest's driver runs on the cluster, as a task."""
    from petatrain.data.ingest import run
    from petatrain.runtime.cluster import init_ray, is_client_address

    job = IngestJob(
        sources=list(sources),
        out=out,
        config=config or IngestConfig(),
        append=append,
        register=register,
        refresh=refresh,
        connect=functools.partial(init_ray, address, local_cpus),
        options=options,
        on_stage=on_stage,
        on_progress=on_progress,
    )
    if is_client_address(address):
        from petatrain.runtime.ingest_task import run_on_cluster

        return run_on_cluster(job)
    return run(job)


def inspect(
    dataset: str, *, options: StorageOptions | None = None, verify: bool = False, samples: int = 3
) -> DatasetReport:
    """Schema, counts and sample rows of a dataset; `verify` re-hashes every shard."""
    from petatrain.data.inspect import describe

    return DatasetReport.from_dict(describe(dataset, options=options, verify=verify, samples=samples))


def check_resume(dataset: str) -> ResumeCheck:
    """The loader's promise on `dataset`: every sample exactly once across a stop and a resume
    at another world size (simulated ranks in this process)."""
    from petatrain.data.loading.elastic_demo import elastic_resume

    d = elastic_resume(dataset)
    return ResumeCheck(
        exactly_once=d["exactly_once"],
        samples_in_epoch=d["samples_in_epoch"],
        ranks_before=d["ranks_before"],
        ranks_after=d["ranks_after"],
        fields=d,
    )


def synthetic_corpus(folder: str, *, documents: int, files: int = 4) -> Corpus:
    """A JSONL corpus with planted exact and near duplicates and bad records (the demo's)."""
    from petatrain.data import synth

    return synth.generate(folder, documents=documents, files=files)


# -- training -------------------------------------------------------------------------------


def soak_schedule(config: JobConfig, *, every: str, duration: str, seed: int = 0) -> tuple[list[str], float]:
    """A random fault (kind and rank from `seed`) every `every` ("120s") for `duration` ("20m"):
    the injection specs for `train`, and its `stop_after_s`."""
    from petatrain.chaos.soak import parse_duration, soak_injections

    specs = soak_injections(every, duration, seed=seed, workers=config.parallel.worker_range()[0])
    return specs, parse_duration(duration, "--for")


def driver_log_path(run_dir: str, options: StorageOptions | None = None) -> str | None:
    """Where a run keeps its driver's Ray log, `RUN/logs/ray-driver.log`, when the run is on a local disk."""
    from petatrain.storage.fs import is_local, resolve

    if not is_local(run_dir):
        return None
    return os.path.join(os.path.abspath(resolve(run_dir, options)[1]), "logs", "ray-driver.log")


def metrics_targets_path(run_dir: str, options: StorageOptions | None = None) -> str:
    """Where a run names its metrics endpoint for Prometheus' `file_sd_configs` while it runs:
    `RUN/prometheus/targets.json` (an absolute path for a run on a local disk)."""
    from petatrain.observe.metrics import TARGETS_FILE
    from petatrain.storage import join
    from petatrain.storage.fs import is_local, resolve

    if is_local(run_dir):
        return os.path.join(os.path.abspath(resolve(run_dir, options)[1]), TARGETS_FILE)
    return join(run_dir, TARGETS_FILE)


def remove_run(run_dir: str, options: StorageOptions | None = None) -> None:
    """Delete a run directory and everything in it (the demo starts afresh each time)."""
    from petatrain.storage.fs import remove_tree

    remove_tree(run_dir, options)


def train(
    config: JobConfig,
    *,
    run_dir: str | None = None,
    address: str = "",
    injections: Sequence[str] = (),
    on_event: Callable[[events.Event], None] | None = None,
    stop_after_s: float | None = None,
    options: StorageOptions | None = None,
    resume: bool = False,
    branch: str | None = None,
    carry: str | None = None,
) -> TrainResult:
    """Train `config` in `run_dir` (default `.petatrain/runs/DATE-TIME`), recovering from faults.

    `injections`: faults such as "kill@step=17,rank=1". `on_event` receives every event of
    the run's ledger as it is written (steps from every rank included), in ledger order.
    `resume`: continue the run `run_dir` holds (same run, next attempt, newest checkpoint);
    without it a run directory that holds a run is refused.
    `branch`: "RUN" or "RUN@STEP": start from that run's checkpoint (its newest, or of step
    STEP): weights, optimizer, loader position and RNG, trained on with this config (a new
    learning rate, more steps).
    `carry`: "RUN" or "RUN@STEP" (`train --continue`): start a new run from that checkpoint with
    its data position carried onto a later version of the dataset (every new row once, with a
    `data.replay` share of the old) and the learning-rate schedule started again at its step
    (`train.schedule_start`), trained to `train.steps`.
    """
    from petatrain.chaos.inject import parse
    from petatrain.runtime.driver import TrainJob
    from petatrain.runtime.driver import run as launch

    options = options or config.storage.options()
    if branch and carry:
        raise ConfigError("--from and --continue are two ways to start from a checkpoint: give one")
    fork = _branch(branch, options) if branch else _branch(carry, options, carry=True) if carry else None
    if fork is not None and fork.carry:
        if config.train.steps <= fork.step:
            raise ConfigError(
                f"--continue {fork.label}: train.steps {config.train.steps} is not past step {fork.step}; a "
                f"continuation trains to a later step (e.g. --set train.steps={fork.step + config.train.steps})"
            )
        if not config.train.schedule_start:
            config = dataclasses.replace(config, train=dataclasses.replace(config.train, schedule_start=fork.step))
        if run_dir is None:  # idempotent: a retry of this continuation resumes (or returns) the same run
            run_dir, resume = continuation_dir(fork, config, options), True
    run_url = run_dir or os.path.join(".petatrain", "runs", time.strftime("%Y%m%d-%H%M%S"))
    job = TrainJob(
        config=config,
        run_url=run_url,
        options=options,
        address=address,
        injections=[parse(s) for s in injections],
        stop_after_s=stop_after_s,
        resume=resume,
        branch=fork,
    )
    follower = LedgerFollower(run_url, options, on_event) if on_event else None
    try:
        launched = launch(job)
    finally:
        if follower:
            follower.stop()
    run_report = report(launched.run, options=options)
    if config.observe.mlflow_uri:
        _mirror_run(launched.run, config, options)
    return TrainResult(  # from the driver's runtime.driver.RunResult
        run=launched.run,
        final=launched.final,
        steps=launched.steps,
        attempts=launched.attempts,
        failures=[FaultRecord(cause=f.cause.value, rank=f.rank, detail=f.detail) for f in launched.failures],
        wall_s=launched.wall_s,
        report=run_report,
        fields=launched.to_dict(),  # the run's summary, as its ledger and `train --json` have it
    )


def continuation_run_dir(config: JobConfig, carry: str, options: StorageOptions | None = None) -> str:
    """The run directory of `train --continue CARRY` without --run-dir (see continuation_dir)."""
    options = options or config.storage.options()
    fork = _branch(carry, options, carry=True)
    if not config.train.schedule_start:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, schedule_start=fork.step))
    return continuation_dir(fork, config, options)


def continuation_dir(fork: Any, config: JobConfig, options: StorageOptions | None) -> str:
    """Where `train --continue` runs without --run-dir: beside the run it continues, named by what
    makes the continuation (the checkpoint, the dataset version it goes on to, the config), so that
    running it again (an orchestrator's retry) finds the same run: `RUN+vVERSION-DIGEST`."""
    from petatrain.data.index import read_manifest, split_version
    from petatrain.observe.ledger import prior_run_from, typed_events

    root, version = split_version(config.data.dataset)
    if version is None:  # the latest version, as the run will pin it
        manifest = read_manifest(root, options)
        if manifest is None:
            raise ConfigError(f"data.dataset: {root} is not a committed dataset")
        version = manifest.generation
    prior = prior_run_from(typed_events(fork.source, options))
    pinned = dataclasses.replace(config, data=dataclasses.replace(config.data, dataset=f"{root}@v{version}"))
    digest = _digest({"source": prior.run_id if prior else fork.source, "step": fork.step, "config": pinned.to_dict()})
    parent, _, name = fork.source.rstrip("/").rpartition("/")
    return join(parent or ".", f"{name}+v{version}-{digest}")


def _digest(what: dict[str, Any]) -> str:
    """8 hex digits naming `what` (a run's source, step and config): a run directory named by what
    makes the run, so that the same work asked again finds it."""
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _redacted(uri: str) -> str:
    """A URL without the user and password it may carry."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else ""))) if parts.netloc else uri


def _mirror_run(run: str, config: JobConfig, options: StorageOptions | None) -> dict[str, Any]:
    """The run logged to MLflow (observe.mlflow_uri); the ledger's `mlflow` event says whether it was,
    or why not (then `petatrain mlflow sync RUN` logs it later). Training's result does not depend on it."""
    from petatrain.observe import mlflow

    uri = config.observe.mlflow_uri
    try:
        done = mlflow.sync_run(run, uri, config.observe.mlflow_experiment, options)
        event = events.Mlflow(status="logged", uri=_redacted(uri), mlflow_run_id=done["mlflow_run_id"])
    except Exception as exc:  # MLflow down, unreachable, refusing: the run stands, the ledger says so
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log.warning("%s was not logged to MLflow at %s (%s); `petatrain mlflow sync %s` logs it later",
                    run, _redacted(uri), detail, run)  # fmt: skip
        event, done = events.Mlflow(status="pending", uri=_redacted(uri), detail=detail), {"pending": detail}
    _record_mlflow(run, event, options)
    return done


def _record_mlflow(run: str, event: events.Mlflow, options: StorageOptions | None) -> None:
    """The run ledger's `mlflow` event: logged (with the MLflow run), or pending and why."""
    from petatrain.observe.ledger import EventLog

    ledger = EventLog(run, options)
    try:
        ledger.write_event(event)
    finally:
        ledger.close()


def _branch(spec: str, options: StorageOptions | None, *, carry: bool = False) -> Any:
    """ "RUN" or "RUN@STEP" -> runtime.driver.Branch, the step checked against RUN's committed checkpoints."""
    from petatrain.runtime.driver import Branch
    from petatrain.storage.fs import is_local
    from petatrain.train.checkpoint.branch import source_step

    source, at, step = spec.rpartition("@")
    if not at or not step.isdigit():
        source, step = spec, ""
    if is_local(source):
        source = os.path.abspath(source)
    chosen = source_step(source, int(step) if step else None, options, flag="--continue" if carry else "--from")
    return Branch(source=source, step=chosen, label=f"{source}@{chosen}", carry=carry)


def tune(
    config: JobConfig,
    out: str,
    *,
    params: Sequence[str] = (),
    address: str = "",
    injections: Sequence[str] = (),
    on_progress: Callable[[str], None] | None = None,
    options: StorageOptions | None = None,
    shared_cache: bool = True,
) -> dict[str, Any]:
    """A hyperparameter search on Ray Tune: `config.tune` says how (scheduler, trials, metric),
    `params` ("train.lr=loguniform:1e-4:1e-2") add to or replace its `tune.params`. Each trial is
    a training run in OUT/trials/<id>/; the best trial's config is written to OUT/best.yaml and
    the search's table, curves and decisions to OUT/tune.json and OUT/tune.html. On an OUT that
    holds the same search, the search is resumed. `shared_cache=False` gives every trial a shard
    cache of its own (as trials of a plain Tune search have; for comparison). Returns tune.json's content."""
    from petatrain.tune import space
    from petatrain.tune.search import SearchJob, run

    given = {s.key: str(s) for s in map(space.parse, params)}
    settings = dataclasses.replace(config.tune, params={**config.tune.params, **given})
    job = SearchJob(
        config=dataclasses.replace(config, tune=settings),
        out=out,
        address=address,
        injections=list(injections),
        options=options,
        on_progress=on_progress,
        shared_cache=shared_cache,
    )
    return run(job)


def report(run: str, *, options: StorageOptions | None = None) -> RunReport:
    """Write the run's goodput report (report.json, report.html, plots) and return it."""
    from petatrain.observe.report import write_report

    return RunReport.from_dict(write_report(run, options))


def lineage(run: str, *, options: StorageOptions | None = None, registry: str | None = None) -> list[dict[str, Any]]:
    """The run and each run it started from (`train --continue`, `--from`), newest first: the
    dataset versions each read and how much (new rows, replayed rows, whole epochs), its steps,
    tokens, status, last evaluation loss, and the registry versions it was promoted as (`registry`,
    else $PETATRAIN_REGISTRY, else .petatrain/registry, where there is one)."""
    from petatrain.observe.lineage import chain
    from petatrain.registry.store import Registry

    links = chain(run, options)
    promoted = Registry(registry, options).promotions_of({str(link["run"]) for link in links})
    for link in links:
        if not link.get("missing"):
            link["promotions"] = promoted.get(str(link["run"]), [])
    return links


def dataset_gc(
    dataset: str,
    *,
    keep: int,
    runs: Sequence[str] = (),
    registry: str | None = None,
    options: StorageOptions | None = None,
) -> dict[str, Any]:
    """Remove the versions of `dataset` older than its latest `keep`, but any that a run under the
    `runs` folders (default .petatrain/runs) or a version of the registry still names (data/gc.py).
    {"removed", "kept", "in_use": {version: [who names it]}}."""
    from petatrain.data import gc
    from petatrain.data.index import split_version
    from petatrain.registry.store import Registry

    folders = list(runs) or [os.path.join(".petatrain", "runs")]
    root = split_version(dataset)[0]
    named = gc.users(root, folders, Registry(registry, options), options)
    return gc.collect(root, keep, named, options)


def dataset_events(dataset: str, *, after: int = 0, options: StorageOptions | None = None) -> dict[str, Any]:
    """The `dataset.committed` events of `dataset`'s versions after `after` (data/commit_log.py):
    {"dataset", "after", "events": [...]}, oldest first."""
    from petatrain.data import commit_log
    from petatrain.data.index import read_manifest, split_version

    if after < 0:
        raise ConfigError(f"--after must be a version number >= 0, got {after}")
    root = split_version(dataset)[0]
    if read_manifest(root, options) is None:
        raise PetatrainError(f"{root} is not a committed dataset (no {root}/_index/manifest.json)")
    return {"dataset": root, "after": after, "events": commit_log.read(root, after, options)}


# -- the model registry ---------------------------------------------------------------------


def _model_at(ref: str, registry: Any, options: StorageOptions | None) -> tuple[str, str, dict[str, Any] | None]:
    """(run, checkpoint, registry record or None) of a model reference: a run, or registry://NAME@X."""
    from petatrain.registry.store import parse_ref

    parsed = parse_ref(ref)
    if not parsed.is_registry:
        return ref, "final", None
    record = registry.resolve(parsed)
    return str(record["run"]), str(record["checkpoint"]), record


def evaluate(
    candidate: str,
    *,
    against: str | None = None,
    config: JobConfig | None = None,
    registry: str | None = None,
    dataset: str | None = None,
    options: StorageOptions | None = None,
) -> dict[str, Any]:
    """The evaluation gate (registry/gate.py): `candidate` (a run, or registry://NAME@X) and
    `against` (the model it would replace) on the same held-out rows of `dataset` (default: the
    version the candidate trained on), split into all / newest / earlier rows, and the verdict of
    `config.promote`'s policy. A registry record is verified, and the weights against it."""
    from petatrain.registry import gate
    from petatrain.registry.store import Registry

    cfg = config or JobConfig()
    options = options or cfg.storage.options()
    store = Registry(registry or cfg.promote.registry or None, options)
    loaded: list[Any] = []  # registry.gate.Loaded, or None where there is nothing to compare with
    for ref in (candidate, against):
        if ref is None:
            loaded.append(None)
            continue
        run, checkpoint, record = _model_at(ref, store, options)
        model = gate.load_model(run, checkpoint, options, ref)
        if record is not None and model.describe["checksum"] != record["checksum"]:
            raise CorruptDataError(
                f"{ref}: the weights of {run} ({checkpoint}) do not match the registry record "
                f"({model.describe['checksum']} != {record['checksum']})"
            )
        loaded.append(model)
    cand, inc = loaded
    assert cand is not None
    data = cand.config.data
    if data.eval_split != "rows" or not data.eval_fraction:
        raise ConfigError(
            f"{candidate}: it held out data.eval_split {data.eval_split}; evaluate compares models on the rows "
            "split (data.eval_split: rows), whose held-out rows are the same in every version"
        )
    target = dataset or data.dataset
    if inc is not None:
        from petatrain.data.index import split_version

        if split_version(inc.config.data.dataset)[0] != split_version(target)[0]:
            raise ConfigError(
                f"{against} trained on {split_version(inc.config.data.dataset)[0]}, {candidate} on "
                f"{split_version(target)[0]}: models are compared on the held-out rows of one dataset"
            )
    limit = cfg.promote.max_rows
    results = {"candidate": gate.held_out_losses(cand, target, data.eval_fraction, options, limit)}
    if inc is not None:
        results["against"] = gate.held_out_losses(inc, target, data.eval_fraction, options, limit)
    return {
        "candidate": {"ref": candidate, **cand.describe},
        "against": {"ref": against, **inc.describe} if inc is not None else None,
        "dataset": target,
        "eval_fraction": data.eval_fraction,
        "losses": results,
        "verdict": gate.verdict(results["candidate"], results.get("against"), cfg.promote),
    }


def promote(
    run: str,
    model: str,
    *,
    checkpoint: str = "final",
    force: bool = False,
    config: JobConfig | None = None,
    registry: str | None = None,
    options: StorageOptions | None = None,
) -> dict[str, Any]:
    """Register `run`'s weights (final, or checkpoint STEP) as the next version of `model` and move
    its `champion` alias to it, if the evaluation gate against the current champion passes (or
    `force`). The version's record: run, checkpoint, checksum, lineage, evaluation."""
    from petatrain.registry.store import DEFAULT_ALIAS, SCHEME, Registry, check_name
    from petatrain.train.weights import load

    cfg = config or JobConfig()
    options = options or cfg.storage.options()
    store = Registry(registry or cfg.promote.registry or None, options)
    check_name(model)
    champion = store.alias(model, DEFAULT_ALIAS)
    against = f"{SCHEME}{model}@{DEFAULT_ALIAS}" if champion is not None else None
    served = load(run, checkpoint, options)  # verified: what the record names is what is there
    weights = {"run": served.run, "checkpoint": checkpoint if checkpoint == "final" else str(served.step)}
    registered = store.find(model, {**weights, "checksum": served.checksum})
    if registered is not None and champion is not None and champion["version"] == registered["version"]:
        return registered  # promoted already (a retry): nothing to evaluate, nothing to write
    evaluation = None
    try:
        evaluation = evaluate(run, against=against, config=cfg, registry=store.url, options=options)
    except ConfigError:
        if not force:
            raise
    if evaluation is not None and not evaluation["verdict"]["passed"] and not force:
        raise GateRefused(
            f"{run} does not pass the gate against {against}: {evaluation['verdict']['reason']} "
            "(petatrain evaluate shows the figures; --force promotes anyway)",
            evaluation,
        )
    chain = lineage(run, options=options, registry=store.url)
    fields = {
        "run": served.run,
        "run_id": chain[0].get("run_id", ""),
        "checkpoint": weights["checkpoint"],
        "step": served.step,
        "checksum": served.checksum,
        "dataset": served.config.data.dataset,
        "lineage": chain,
        "eval": evaluation,
        "forced": bool(force and (evaluation is None or not evaluation["verdict"]["passed"])),
    }
    record = store.register(model, fields)
    if cfg.observe.mlflow_uri:
        record = {**record, "mlflow": _mirror_promotion(record, cfg, options)}
    return record


def _mirror_promotion(record: dict[str, Any], cfg: JobConfig, options: StorageOptions | None) -> dict[str, Any]:
    """A promotion mirrored in MLflow's registry (the run logged first if it was not); what was done."""
    from petatrain.observe import mlflow

    uri, experiment = cfg.observe.mlflow_uri, cfg.observe.mlflow_experiment
    try:
        run_id = mlflow.mlflow_run_id(str(record["run"]), uri, experiment, options)
        if run_id is None:
            run_id = mlflow.sync_run(str(record["run"]), uri, experiment, options)["mlflow_run_id"]
        return {"version": mlflow.mirror_version(record, uri, run_id), "run_id": run_id}
    except Exception as exc:  # the registry of record has it; MLflow gets it with `petatrain mlflow sync`
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log.warning("registry://%s@%s was not mirrored to MLflow (%s)", record["name"], record["version"], detail)
        return {"pending": detail}


def mlflow_sync(
    run: str, *, config: JobConfig | None = None, registry: str | None = None, options: StorageOptions | None = None
) -> dict[str, Any]:
    """Log `run` to MLflow now (what its last sync did not, or what was pending), and mirror the
    registry versions it was promoted as, with each model's champion alias."""
    from petatrain.observe import mlflow
    from petatrain.registry.store import DEFAULT_ALIAS, Registry

    cfg = config or JobConfig()
    if not cfg.observe.mlflow_uri:
        raise ConfigError("observe.mlflow_uri is not set: --set observe.mlflow_uri=http://HOST:5000")
    options = options or cfg.storage.options()
    uri = cfg.observe.mlflow_uri
    done = mlflow.sync_run(run, uri, cfg.observe.mlflow_experiment, options)
    store = Registry(registry or cfg.promote.registry or None, options)
    versions = []
    for promoted in store.promotions_of({run}).get(run, []):
        name, _, number = promoted.partition("@v")
        record = store.record(name, int(number))
        champion = store.alias(name, DEFAULT_ALIAS)
        alias = DEFAULT_ALIAS if champion is not None and champion["version"] == record["version"] else None
        versions.append(
            {"model": promoted, "mlflow_version": mlflow.mirror_version(record, uri, done["mlflow_run_id"], alias)}
        )
    _record_mlflow(
        run, events.Mlflow(status="logged", uri=_redacted(uri), mlflow_run_id=done["mlflow_run_id"]), options
    )
    return {**done, "versions": versions}


def rollback(
    model: str, *, registry: str | None = None, options: StorageOptions | None = None, config: JobConfig | None = None
) -> dict[str, Any]:
    """Move `model`'s champion alias back to the version it named before."""
    from petatrain.registry.store import Registry

    cfg = config or JobConfig()
    store = Registry(registry or cfg.promote.registry or None, options or cfg.storage.options())
    moved = store.rollback(model)
    if cfg.observe.mlflow_uri:
        from petatrain.observe import mlflow

        try:
            mlflow.move_alias(model, str(moved["alias"]), int(moved["version"]), cfg.observe.mlflow_uri)
        except Exception as exc:  # the registry of record moved; MLflow's alias follows on the next sync
            log.warning("MLflow's alias of %s was not moved back: %s", model, str(exc).splitlines()[0][:300])
    return moved


@dataclass(slots=True)
class LoopCycle:
    """What one cycle of the loop did (`loop_cycle`)."""

    outcome: str  # "idle" (no data), "done" (this version's cycle is over), "promoted", "rejected"
    version: int = 0  # the dataset version the cycle is about (0: none yet)
    record: dict[str, Any] = field(default_factory=dict)  # the cycle's record (loop/records.py)
    ingested: IngestSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        ingested = dataclasses.asdict(self.ingested) if self.ingested is not None else None
        return {"outcome": self.outcome, "version": self.version, "record": self.record, "ingested": ingested}


def loop_cycle(
    spec: Any,
    files: Sequence[str] = (),
    *,
    address: str = "",
    options: StorageOptions | None = None,
    on_step: Callable[[str, dict[str, Any]], None] | None = None,
    only: str = "",
    injections: Sequence[str] = (),
) -> LoopCycle:
    """One cycle of the continuous-training loop `spec` (a `petatrain.loop.spec.LoopSpec`): append
    `files` (stable new source files, the watcher's) to the dataset, then bring the model up to its
    latest version: continue the champion's run onto it (the first time: train from scratch),
    evaluate against the champion and promote if the gate passes. The first run trains `spec.steps`
    (else the job's train.steps); a continuation trains its carry-over pass, every row the versions
    since its source added once with a `data.replay` share of the rows before (and one step more, so
    that it ends outside the pass and the next cycle can carry it on). `on_step(step, fields)` is told
    each step as it starts ("ingest", "train", "promote") and the cycle's end ("done").

    Every step is idempotent, so a cycle killed anywhere and run again ends as one uninterrupted:
    the append skips the files the dataset holds, the continuation's run directory is named by what
    makes it (it resumes, or returns its result), a promotion of registered weights returns their
    version. A version whose cycle is over has a record (`RUNS/_loop/cycles/vN.json`) and is never
    trained again; the gate's refusal is recorded with its reason, and the champion serves on.

    `only` runs one part, for an orchestrator's tasks: "ingest" (the append; outcome "committed" with
    the version's `dataset.committed` event as the record, or "idle" / "done" when nothing new came),
    "train" (the run for the latest version, not promoted: outcome "trained"), "promote" (the cycle
    without an append: the run's result as recorded, the gate, the promotion and the record).
    `injections` are faults injected into the cycle's run, as `train`'s (each fires once per run: a
    cycle run again after one does not fire it again)."""
    from petatrain.data import commit_log
    from petatrain.data.index import read_manifest, split_version
    from petatrain.data.manifest import epoch, now
    from petatrain.loop import records
    from petatrain.registry.store import DEFAULT_ALIAS, Registry

    cfg = spec.job_config()
    options = options or cfg.storage.options()
    tell = on_step or (lambda step, fields: None)
    started, times = time.time(), {}
    if only not in ("", "ingest", "train", "promote"):
        raise ConfigError(f"--only {only!r}: ingest, train or promote")
    summary = None
    before = read_manifest(spec.dataset, options)
    if files and only in ("", "ingest"):
        tell("ingest", {"files": len(files)})
        begun = time.perf_counter()
        summary = ingest(
            files, spec.dataset, config=cfg.ingest, append=before is not None, address=address, options=options
        )
        times["ingest"] = round(time.perf_counter() - begun, 3)
    manifest = read_manifest(spec.dataset, options)
    if manifest is None:
        return LoopCycle("idle", ingested=summary)
    version = manifest.generation
    if only == "ingest":  # the latest version's commit event, and whether its cycle is over
        event = next(iter(commit_log.read(spec.dataset, after=version - 1, options=options)), {})
        announced = {**event, "version": version, "handled": records.read(spec.state, version, options) is not None}
        fresh = before is None or before.generation != version
        return LoopCycle("committed" if fresh else "done", version, announced, summary)
    done = records.read(spec.state, version, options)
    if done is not None:
        return LoopCycle("done", version, done, summary)
    event = next(iter(commit_log.read(spec.dataset, after=version - 1, options=options)), {})
    store = Registry(spec.registry or cfg.promote.registry or None, options)
    champion = store.alias(spec.model, DEFAULT_ALIAS)
    base = store.record(spec.model, int(champion["version"])) if champion is not None else None
    pinned = f"{split_version(spec.dataset)[0]}@v{version}"
    steps = spec.steps or cfg.train.steps  # the first run's
    begun = time.perf_counter()
    current = base is not None and _same_version(str(base.get("dataset", "")), pinned)  # the champion has it
    if base is not None and current:
        run, result_steps = str(base["run"]), int(base["step"])
    else:
        job = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=pinned))
        if base is None:  # the first model: from scratch, in a run directory named by what makes it
            job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=steps))
            tell("train", {"version": version, "from": None, "steps": steps})
            run_dir = join(spec.runs, f"v{version}-{_digest({'config': job.to_dict()})}")
            trained = train(job, run_dir=run_dir, resume=True, address=address, options=options, injections=injections)
        else:  # the champion goes on: every row the versions since added once, with its replay share
            from petatrain.runtime.preflight import may_carry

            step = int(base["step"])
            carried = may_carry(_branch(f"{base['run']}@{step}", options, carry=True), job, options)
            # One step past the carry-over pass: the run ends outside it, so the next cycle can carry it on.
            passed = (carried["new_rows"] + carried["replay_rows"]) // job.train.global_batch + 1
            job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=step + passed))
            tell("train", {"version": version, "from": f"{base['run']}@{step}", "steps": step + passed})
            trained = train(job, carry=f"{base['run']}@{step}", address=address, options=options, injections=injections)
        run, result_steps = trained.run, trained.steps
    times["train"] = round(time.perf_counter() - begun, 3)
    if only == "train":
        return LoopCycle("trained", version, {"version": version, "run": run, "steps": result_steps}, summary)
    tell("promote", {"run": run, "model": spec.model})
    begun = time.perf_counter()
    record: dict[str, Any] = {
        "version": version, "dataset": pinned, "committed": event.get("committed"), "run": run,
        "from": None if base is None or current else base["run"],
        "steps": result_steps,
    }  # fmt: skip
    try:
        promoted = promote(run, spec.model, config=cfg, registry=store.url, options=options)
        record.update(outcome="promoted", model_version=promoted["version"], reason="")
        verdict = (promoted.get("eval") or {}).get("verdict") or {}
        record["gate"] = verdict.get("reason", "")
    except GateRefused as refused:
        verdict = refused.evaluation.get("verdict") or {}
        champion_now = store.alias(spec.model, DEFAULT_ALIAS)
        record.update(
            outcome="rejected", reason=verdict.get("reason", str(refused)),
            model_version=champion_now["version"] if champion_now else None,
        )  # fmt: skip
    times["promote"] = round(time.perf_counter() - begun, 3)
    finished = time.time()
    committed_at = epoch(record["committed"])
    record.update(
        started=now(started), finished=now(finished), times=times,
        # data commit -> the model trained on it promoted (the served model follows the alias)
        staleness_s=round(finished - committed_at, 3) if committed_at and record["outcome"] == "promoted" else None,
    )  # fmt: skip
    records.write(spec.state, record, options)
    tell("done", record)
    return LoopCycle(str(record["outcome"]), version, record, summary)


def _same_version(a: str, b: str) -> bool:
    """Whether two DATASET@vN name the same version of the same dataset (a local path however written)."""
    from petatrain.data.index import split_version
    from petatrain.storage.fs import is_local

    (root_a, va), (root_b, vb) = split_version(a), split_version(b)
    if is_local(root_a) and is_local(root_b):
        root_a, root_b = (
            os.path.abspath(root_a.removeprefix("file://")),
            os.path.abspath(root_b.removeprefix("file://")),
        )
    return va is not None and va == vb and root_a.rstrip("/") == root_b.rstrip("/")


def sample(config: JobConfig, run: str, prompts: Sequence[str], *, new_tokens: int = 60) -> list[str]:
    """Continue each prompt with the committed final weights of the run in `run`."""
    from petatrain.train.sample import sample_text

    options = config.storage.options()
    return sample_text(config, run, prompts=list(prompts), new_tokens=new_tokens, options=options)


# -- serving --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Serving:
    """A run's model being served: where, and which weights (`GET /v1/models` says the same)."""

    url: str
    model: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model}


def serve(
    run: str,
    *,
    checkpoint: str = "final",
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str = "",
    follow: bool = False,
    overrides: Sequence[str] = (),
    options: StorageOptions | None = None,
    registry: str | None = None,
) -> Serving:
    """Serve `run`'s model with Ray Serve on `address` (a local Ray by default), as the run's
    `serve:` config says with `overrides` ("serve.max_batch=8") applied. The weights are verified
    here first: a corrupt, torn or uncommitted checkpoint is refused before anything is deployed,
    and every replica verifies what it loads again. With `follow` (checkpoint "latest"), each replica
    switches to every newer checkpoint the run commits. `stop_serving()` ends it.

    `run` may be `registry://NAME@ALIAS` (or `@VERSION`): the version the registry (`registry`, else
    $PETATRAIN_REGISTRY, else .petatrain/registry) names, its record and weights verified; with
    `follow`, each replica switches whenever the alias moves (a promotion, a rollback)."""
    import dataclasses

    from petatrain import config as config_mod
    from petatrain.registry.store import Registry, parse_ref
    from petatrain.runtime import cluster
    from petatrain.train import weights

    if not 0 < port <= 65535:  # before anything is read or started (ServeOptions checks it again)
        raise ConfigError(f"--port {port}: a TCP port is 1..65535")
    ref, model_ref, registry_url = parse_ref(run), "", ""
    if ref.is_registry:
        store = Registry(registry, options)
        record = store.resolve(ref)
        if follow and ref.selector.isdigit():
            raise ConfigError(f"--follow follows an alias (registry://{ref.name}@champion), not version {ref.selector}")
        model_ref, registry_url = run, store.url
        run, checkpoint = str(record["run"]), str(record["checkpoint"])
    elif follow and checkpoint != "latest":
        raise ConfigError(f"--follow switches to each new checkpoint: use --checkpoint latest, not {checkpoint}")
    options = weights.run_options(run, options)  # the run's keyring unless the command names one
    served = weights.load(run, checkpoint, options)
    if model_ref and served.checksum != record["checksum"]:
        raise CorruptDataError(
            f"{model_ref}: the weights of {run} ({checkpoint}) are not those its registry record names "
            f"({served.checksum} != {record['checksum']})"
        )
    settings = served.config.serve
    if overrides:
        values = config_mod.apply_overrides({"serve": dataclasses.asdict(settings)}, list(overrides))
        settings = config_mod.build(config_mod.ServeConfig, values["serve"], "serve.")
    cluster.init_ray(address, tls=served.config.resources.tls)
    from petatrain.serve import app

    serve_options = app.ServeOptions(
        run_url=run,
        checkpoint=checkpoint,
        host=host,
        port=port,
        settings=settings,
        storage=options.for_workers(),  # replicas may lack this process's AWS_* / OS_* variables
        follow=follow,
        model_ref=model_ref,
        registry=registry_url,
    )
    return Serving(url=app.start(serve_options), model=served.describe())


def stop_serving(*, ray_too: bool = False) -> None:
    """Delete the application and shut Serve down; with `ray_too`, Ray as well (the local Ray `serve`
    started goes with its dashboard and agents; from a cluster, this process disconnects)."""
    from petatrain.serve import app

    try:
        app.stop()
    finally:
        if ray_too:
            from petatrain.runtime.cluster import stop_ray

            stop_ray()


# -- planning -------------------------------------------------------------------------------


def plan(
    config: JobConfig,
    *,
    accelerator: str = "",
    count: int = 0,
    max_count: int = 1024,
    budget_usd: float = 0.0,
    deadline_hours: float = 0.0,
    mtbf_hours: float = 0.0,
) -> Plan:
    """Estimate every accelerator (or `accelerator`), count (or `count`, else powers of two up to
    `max_count`) and strategy, and recommend one: the cheapest that meets `deadline_hours`, the
    fastest within `budget_usd`, else the cheapest. 0 means no limit; `mtbf_hours` 0: faults.mtbf_hours."""
    from petatrain.plan.recommend import PlanRequest
    from petatrain.plan.recommend import plan as recommend

    request = PlanRequest(
        accelerator=accelerator,
        count=count,
        max_count=max_count,
        budget_usd=budget_usd,
        deadline_hours=deadline_hours,
        mtbf_hours=mtbf_hours,
    )
    return recommend(config, request)


def profile_layers(config: JobConfig, *, repetitions: int = 5, save: bool = True) -> dict[str, Any]:
    """Measure each unit of the model (embedding, blocks, head) and the link between two ranks here,
    save the layer profile the `profile` pipeline partitioner reads, and compare the partitions."""
    from petatrain.plan.pipeline import profile_layers as measure

    return measure(config, repetitions=repetitions, save=save)


def profile(config: JobConfig, *, steps: int = 5, use_dataset: bool = False, save: bool = True) -> ProfileReport:
    """Run real training steps here, compare them with the plan's estimate, save a calibration."""
    from petatrain.plan.profile import profile as measure

    d = measure(config, steps=steps, use_dataset=use_dataset, save=save)
    return ProfileReport(
        device=d["device"], steps=d["steps"], verdict=d["verdict"], calibration_path=d.get("calibration_path"), fields=d
    )


def use_ray_tls(config: JobConfig) -> None:
    """Turn Ray's TLS on in this process as `resources.tls` says (call it before anything loads Ray:
    its core library reads the settings once); nothing when the config has none."""
    from petatrain.runtime.tls import enable

    enable(config.resources.tls)


def make_ray_tls(folder: str, hosts: Sequence[str]) -> dict[str, Any]:
    """`petatrain keys tls`: a CA and a node certificate for Ray's TLS; the config and the environment."""
    from petatrain.runtime.tls import make_certificates

    files = make_certificates(folder, list(hosts))
    config = {"ca": files.ca, "cert": files.cert, "key": files.key}
    return {"folder": os.path.abspath(folder), "config": config, "env": files.env()}


def create_keys(path: str) -> dict[str, Any]:
    """`petatrain keys create`: a new local keyring; what it holds (never the keys)."""
    from petatrain.security import keys

    ring = keys.create_keyring(path)
    return {"keyref": ring.ref, "primary": ring.primary, "versions": ring.versions, "key_id": ring.key_id}


def export_public_key(keyref: str, out: str) -> dict[str, Any]:
    """`petatrain keys public`: the keyring's verification key alone, at `out`."""
    from petatrain.security import keys

    return {"path": os.path.abspath(out), "key_id": keys.export_public(keyref, out)}


def rotate_keys(keyref: str, targets: Sequence[str], *, retire: bool = False) -> dict[str, Any]:
    """`petatrain keys rotate`: a new master key version, then every target's data keys re-wrapped
    with it (datasets: the manifest's dataset keys; runs: each checkpoint's and the final weights'
    records); no data is rewritten. `retire` then drops the older versions from the keyring."""
    from petatrain.data import index
    from petatrain.security import keys
    from petatrain.storage.fs import canonical_url, exists, join
    from petatrain.storage.lock import LEASE_FILE, Lease
    from petatrain.train.checkpoint.rewrap import rewrap_run

    targets = [canonical_url(t) for t in targets]  # as the keyring records them: ./ds and /abs/ds are one
    options = StorageOptions(protection=Protection(encryption_key=keyref, signing_key=keyref))
    keys.open_keys(keyref)  # a missing or loose keyring: refused before anything changes

    def is_dataset(target: str) -> bool:
        return exists(join(target, index.MANIFEST), options)

    def is_run(target: str) -> bool:
        return exists(join(target, ".petatrain-run"), options) or exists(join(target, "checkpoints"), options)

    datasets = [t for t in targets if is_dataset(t)]
    for target in targets:  # every target checked before the keyring gets its new version
        if target not in datasets and not is_run(target):
            raise ConfigError(f"{target} is neither a petatrain dataset nor a run; nothing was changed")
    if retire:  # what an earlier rotation re-wrapped, and still exists, would become unreadable
        left = [t for t in keys.rotated_targets(keyref) if t not in targets and (is_dataset(t) or is_run(t))]
        if left:
            raise ConfigError(
                f"--retire would leave {', '.join(left)} unreadable: an earlier rotation of {keyref} re-wrapped "
                f"{'it' if len(left) == 1 else 'them'}, and {'it is' if len(left) == 1 else 'they are'} not named "
                "here; name every dataset and run the keyring encrypts. Nothing was changed"
            )
    version = keys.add_master_version(keyref)
    done = []
    for target in targets:
        if target in datasets:
            done.append(index.rewrap_dataset(target, options))
        else:
            with Lease(join(target, LEASE_FILE), kind="keys", what=target, options=options):
                done.append(rewrap_run(target, options))
    keys.record_targets(keyref, targets)
    retired = keys.retire_versions(keyref, version) if retire else []
    return {"keyref": keyref, "key_version": version, "rewrapped": done, "retired": retired}


@dataclass(frozen=True, slots=True)
class Deployment:
    """What `deploy_k8s` wrote: the files, the sizes chosen and why."""

    files: list[str]
    kind: str
    workers: tuple[int, int]
    worker_pods: tuple[int, int]
    accelerator: str
    devices_per_node: int
    sized_by: str  # "config" | "plan: ..." | "--count"
    secrets: list[str]  # the `kubectl create secret` commands of the Secrets referenced (no values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files, "kind": self.kind, "workers": list(self.workers),
            "worker_pods": list(self.worker_pods), "accelerator": self.accelerator,
            "devices_per_node": self.devices_per_node, "sized_by": self.sized_by, "secrets": self.secrets,
        }  # fmt: skip


def deploy_k8s(config: JobConfig, target: Any, out: str, *, from_plan: bool = False, count: int = 0) -> Deployment:
    """Write KubeRay manifests for `config` into `out` (one YAML file per document, dumped once).

    `target`: a `petatrain.deploy.manifests.Target`. Sizes: `count` accelerators (or workers on CPU),
    else with `from_plan` `plan`'s recommendation on `target.accelerator` (any when ""), else the
    config's `parallel.workers`. Every file is validated before it is written."""
    import dataclasses as dc

    from petatrain import config as config_mod
    from petatrain.deploy import manifests
    from petatrain.plan.catalog import load_catalog

    sized_by = "config"
    if not 0 <= count <= config_mod.MAX_WORKERS:
        raise ConfigError(
            f"--count {count}: 1 to {config_mod.MAX_WORKERS:,} accelerators (or CPU workers), or 0 for the config's"
        )
    if from_plan:
        chosen = plan(config, accelerator=target.accelerator, count=count).recommended
        if chosen is None:
            raise PetatrainError("plan found no accelerator and count that fits this job: see `petatrain plan`")
        target = dc.replace(target, accelerator=chosen.accelerator)
        count = chosen.count
        # The job runs as planned: its strategy and, for a searched layout, the settings plan chose.
        layout = [f"parallel.workers={count}", *chosen.layout.get("settings", [f"parallel.strategy={chosen.strategy}"])]
        config = config_mod.build(JobConfig, config_mod.apply_overrides(config.to_dict(), layout))
        sized_by = f"plan: {chosen.accelerator} x{chosen.count} " + chosen.layout.get("label", chosen.strategy)
    elif count:
        sized_by = "--count"
    if target.accelerator:
        catalog = load_catalog(config.plan)
        if target.accelerator not in catalog:
            raise ConfigError(f"--accelerator {target.accelerator!r}: not in the catalog ({', '.join(catalog)})")
        per_node = catalog[target.accelerator].node_devices
        target = dc.replace(target, devices_per_node=min(per_node, count or per_node))
    if count:
        target = dc.replace(target, workers=(count, count))
    files = _write_manifests(manifests.build(config, target), out)
    configured = config.serve.replica_range() if target.kind == "rayservice" else config.parallel.worker_range()
    lo, hi = target.workers if target.workers != (0, 0) else configured
    per_pod = target.devices_per_node or 1
    return Deployment(
        files=files, kind=target.kind, workers=(lo, hi), worker_pods=(-(-lo // per_pod), -(-hi // per_pod)),
        accelerator=target.accelerator or "cpu", devices_per_node=target.devices_per_node, sized_by=sized_by,
        secrets=manifests.secrets_needed(config, target),
    )  # fmt: skip


def _write_manifests(documents: list[dict[str, Any]], out: str) -> list[str]:
    """Validate `documents` (a failure is a bug in the builder: all of it is said), then write one
    YAML file each into `out`, numbered in the order `kubectl apply -f` meets them."""
    from petatrain.deploy.manifests import yaml_dump
    from petatrain.deploy.validate import validate_documents

    problems = validate_documents(documents, source="generated")
    if problems:
        raise PetatrainError("the generated manifests do not validate: " + "; ".join(problems))
    os.makedirs(out, exist_ok=True)
    files = []
    for number, doc in enumerate(documents):
        path = os.path.join(out, f"{number:02d}-{doc['kind'].lower()}.yaml")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(yaml_dump(doc))
        files.append(path)
    return files


def deploy_loop_k8s(
    spec: Any,
    target: Any,
    out: str,
    *,
    schedule: str,
    time_zone: str = "",
    cron: str = "raycronjob",
    kfp_service_account: str = constants.KFP_SERVICE_ACCOUNT,
) -> Deployment:
    """Write what runs the loop `spec` (a `petatrain.loop.spec.LoopSpec`) on Kubernetes into `out`: a
    KubeRay RayCronJob running one cycle (`petatrain loop --once`) on `schedule` (`cron`
    "raycronjob"), a Kubernetes CronJob submitting it to a standing RayCluster ("cronjob"), or for a
    Kubeflow pipeline ("kfp") the train step's RayJob as a template and the access its pods
    (`kfp_service_account`) need; and a RayService serving `registry://MODEL@champion` that follows
    it (deploy/manifests.build_loop)."""
    from petatrain.deploy import manifests

    documents = manifests.build_loop(spec, target, schedule, time_zone, cron, kfp_service_account)
    files = _write_manifests(documents, out)
    cfg = spec.job_config()
    lo, hi = cfg.parallel.worker_range()
    every = "per pipeline run" if cron == "kfp" else f"on {schedule!r}"
    return Deployment(
        files=files, kind=cron, workers=(lo, hi), worker_pods=(0 if cron == "cronjob" else lo, hi), accelerator="cpu",
        devices_per_node=0, sized_by=f"config; a cycle {every}",
        secrets=manifests.secrets_needed(cfg, dataclasses.replace(target, run_dir=spec.runs)),
    )  # fmt: skip


def validate_k8s(folder: str) -> list[str]:
    """Every problem of the manifests under `folder`, one line each ([] when all are valid)."""
    from petatrain.deploy.validate import validate_dir

    return validate_dir(folder)
