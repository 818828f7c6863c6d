"""`petatrain tune`: a hyperparameter search on Ray Tune over job-config fields.

Each trial is a petatrain training run (`tune/trial.py`) in `OUT/trials/<trial id>/`. Ray Tune
samples the parameters (random, or Optuna through Tune's `OptunaSearch`), runs as many trials at
once as the cluster holds whole (every trial's gang of workers, from `parallel.workers` and the
cluster's CPUs and GPUs, so gangs never sit half-placed), and its ASHA or PBT scheduler stops
or exploits trials on the metric they report at each evaluation. Tune's own state is in
`OUT/tune/`; `petatrain tune` on the same OUT restores it and goes on.

When the search ends: each trial's run gets its goodput report, a trial ASHA stopped gets an
`end` event saying so, the best trial's config is written as `OUT/best.yaml` (a config `train`
runs as is), and `OUT/tune.json` and `OUT/tune.html` hold the table of trials, every trial's
evaluation curve and the scheduler's decisions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from petatrain.config import JobConfig, TuneConfig
from petatrain.errors import ConfigError, PetatrainError
from petatrain.observe import events as ev
from petatrain.observe.ledger import EventLog, typed_events
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, exists, is_local, read_bytes, resolve
from petatrain.tune import credentials
from petatrain.tune import space as spaces
from petatrain.tune.trial import TrialSetup, configure, run_trial, trial_dir

log = logging.getLogger(__name__)

EXPERIMENT = "tune"  # Ray Tune's experiment folder in OUT
SEARCH_FILE = "search.json"  # what the search is: a later `tune` on OUT must ask for the same
BEST_FILE = "best.yaml"
SUMMARY_FILE = "tune.json"
HTML_FILE = "tune.html"


@dataclass(kw_only=True)
class SearchJob:
    config: JobConfig  # the base config; config.tune says how to search
    out: str
    address: str = ""
    injections: list[str] = field(default_factory=list)  # faults every trial's run is given
    options: StorageOptions | None = None
    on_progress: Callable[[str], None] | None = None  # one line per evaluation and decision
    shared_cache: bool = True  # False: every trial fetches the dataset into a cache of its own (for comparison)


def check(job: SearchJob) -> tuple[list[spaces.Space], int, list[JobConfig]]:
    """The spaces, the steps per trial and the configs at the spaces' corners (what trials span);
    ConfigError (one line) for anything a trial would fail on."""
    cfg, settings = job.config, job.config.tune
    parsed = [spaces.parse_space(key, text) for key, text in settings.params.items()]
    corners = spaces.check(cfg, parsed)
    steps = settings.max_steps or cfg.train.steps
    if settings.scheduler != "none" and not cfg.train.eval_every:
        raise ConfigError(
            f"--scheduler {settings.scheduler} acts on the metric each evaluation reports, and train.eval_every is 0 "
            "(one evaluation, at the end): set --set train.eval_every=N"
        )
    if settings.scheduler == "pbt" and cfg.storage.encryption.key:
        raise ConfigError(
            "--scheduler pbt copies a trial's checkpoints into another trial's run, and encrypted checkpoints "
            "are bound to the run that wrote them (storage.encryption.key): use asha or none"
        )
    if cfg.train.eval_every and cfg.train.eval_every > steps:
        raise ConfigError(f"train.eval_every {cfg.train.eval_every} is beyond the {steps} steps of a trial")
    if settings.search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("--search optuna needs the optuna package: pip install 'petatrain[optuna]'") from None
    return parsed, steps, corners


def trial_shape(cfg: JobConfig, cpus: float, gpus: float) -> tuple[float, float]:
    """CPUs and GPUs one trial's largest gang of workers holds."""
    workers = cfg.parallel.worker_range()[1]
    use_gpu = cfg.resources.accelerator == "gpu" or (cfg.resources.accelerator == "auto" and gpus > 0)
    return workers * cfg.resources.cpus_per_worker, float(workers) if use_gpu else 0.0


def concurrency(cfg: JobConfig, cpus: float, gpus: float, corners: Sequence[JobConfig] = ()) -> int:
    """Trials at once: as many whole gangs as the cluster holds (at least one, else ConfigError), a
    gang as large as the largest trial the spaces' corners make (`parallel.workers` may be searched)."""
    shapes = [trial_shape(c, cpus, gpus) for c in (cfg, *corners)]
    need_cpu, need_gpu = max(s[0] for s in shapes), max(s[1] for s in shapes)
    fits = [int(cpus // need_cpu) if need_cpu else math.inf, int(gpus // need_gpu) if need_gpu else math.inf]
    count = min(fits)
    if count < 1:
        raise ConfigError(
            f"a trial needs {need_cpu:g} CPU(s) and {need_gpu:g} GPU(s) (parallel.workers x resources); "
            f"the cluster has {cpus:g} and {gpus:g}"
        )
    return int(min(count, cfg.tune.trials))


def run(job: SearchJob) -> dict[str, Any]:
    """Run (or resume) the search; returns the summary also written to OUT/tune.json."""
    from ray import tune

    from petatrain.runtime import cluster

    # Filled in from this process's AWS_* variables: trial actors may have started before they were set.
    options = (job.options or job.config.storage.options()).for_workers()
    out = os.path.abspath(job.out) if is_local(job.out) else job.out.rstrip("/")
    if is_local(job.config.data.dataset):  # trials run in folders of Tune's choosing
        data = dataclasses.replace(job.config.data, dataset=os.path.abspath(job.config.data.dataset))
        job = dataclasses.replace(job, config=dataclasses.replace(job.config, data=data))
    parsed, steps, corners = check(job)
    settings = job.config.tune
    description = _description(job.config, parsed, steps, job.injections)
    scheduler = _scheduler(settings, parsed, steps, job.config.train.eval_every)
    _search(settings, 1)  # a missing optuna fails before the folder is claimed
    resuming = _claim(out, description, options)
    cluster.init_ray(job.address or job.config.resources.address, 0, job.config.resources.tls)
    import ray

    totals = ray.cluster_resources()
    concurrent = settings.concurrent or concurrency(job.config, totals.get("CPU", 0), totals.get("GPU", 0), corners)
    setup = TrialSetup(
        base=job.config,
        out=out,
        keys=tuple(s.key for s in parsed),
        steps=steps,
        checkpoints=settings.scheduler == "pbt",
        injections=tuple(job.injections),
        options=options,
        shared_cache=job.shared_cache,
    )
    # The trial actor runs the run's driver: it computes nothing, so it holds no CPU (its workers
    # do); Tune needs some resource in a trial's request, so it asks for one byte of memory.
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"cpu": 0, "memory": 1})
    credentials.hold(out, options)  # for the callbacks: what Tune pickles names the search only
    storage_path, filesystem = credentials.tune_storage(out, options)
    say = job.on_progress or (lambda line: None)
    started = time.time()
    path = f"{storage_path.rstrip('/')}/{EXPERIMENT}"
    if resuming and tune.Tuner.can_restore(path, storage_filesystem=filesystem):
        say(f"resuming the search in {out}")
        tuner = tune.Tuner.restore(
            path, trainable, resume_unfinished=True, resume_errored=True, storage_filesystem=filesystem
        )
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={s.key: s.domain() for s in parsed},
            tune_config=tune.TuneConfig(
                metric=settings.metric,
                mode=settings.mode,
                num_samples=settings.trials,
                max_concurrent_trials=concurrent if settings.search != "random" else None,
                scheduler=scheduler,
                search_alg=_search(settings, concurrent),
            ),
            run_config=tune.RunConfig(
                name=EXPERIMENT,
                storage_path=storage_path,
                storage_filesystem=filesystem,
                failure_config=tune.FailureConfig(max_failures=settings.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=4),
                callbacks=[_Progress(say, steps, settings.metric, out)],
                verbose=0,
            ),
        )
        say(
            f"searching {len(parsed)} parameter(s) over {settings.trials} trials of {steps} steps, "
            f"{concurrent} at once ({settings.scheduler}, {settings.search})"
        )
    # Tune prints its own tables (petatrain's lines are `say`'s), and would hand the AWS_* credentials
    # to its trial actors' runtime environment, which Ray logs: the trials' options carry them.
    with contextlib.redirect_stdout(_ToLog()), credentials.credentials_out_of_environment():
        grid = tuner.fit()
    return _conclude(job.config, grid, out, options, parsed, steps, concurrent, time.time() - started)


class _ToLog(io.TextIOBase):
    """What Tune prints, as log records of `ray.tune` (in Ray's log file, or on the console with --verbose)."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                logging.getLogger("ray.tune").info(line)
        return len(text)


def _description(cfg: JobConfig, parsed: list[spaces.Space], steps: int, injections: list[str]) -> dict[str, Any]:
    base = cfg.to_dict()
    base.pop("tune")
    settings = dataclasses.asdict(cfg.tune)
    settings.pop("params")
    return {
        "params": {s.key: str(s) for s in parsed},
        "settings": settings,
        "steps": steps,
        "config": base,
        "injections": list(injections),
    }


def _claim(out: str, description: dict[str, Any], options: StorageOptions | None) -> bool:
    """Record what the search is in OUT; True when OUT holds this search already (it is resumed).
    A folder holding another search, or anything else, is refused."""
    record = join(out, SEARCH_FILE)
    if exists(record, options):
        before = json.loads(read_bytes(record, options))
        changed = [k for k in ("params", "settings", "steps", "config") if before.get(k) != description[k]]
        if changed:
            raise ConfigError(
                f"--out {out} holds another search (its {', '.join(changed)} differ): give a new --out, "
                "or the same arguments to resume it"
            )
        return True
    if exists(out, options):
        fs, path = resolve(out, options)
        if fs.ls(path, detail=False):
            raise ConfigError(f"--out {out} is not empty and holds no search: give a new or empty folder")
    atomic_write(record, (json.dumps(description, indent=2, default=str) + "\n").encode(), options)
    return False


def _scheduler(settings: TuneConfig, parsed: list[spaces.Space], steps: int, eval_every: int) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if settings.scheduler == "asha":
        return ASHAScheduler(
            time_attr="step",
            max_t=steps,
            grace_period=min(steps, settings.grace_evals * eval_every),
            reduction_factor=settings.reduction_factor,
        )
    if settings.scheduler == "pbt":
        return PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=settings.perturbation_evals * eval_every,
            hyperparam_mutations={s.key: s.domain() for s in parsed},
            quantile_fraction=1.0 / settings.reduction_factor,
            synch=settings.pbt_synch,
        )
    return FIFOScheduler()


def _search(settings: TuneConfig, concurrent: int) -> Any:
    """Tune's search algorithm. Random sampling limits its own concurrency (Tune ignores
    `max_concurrent_trials` for it); Optuna's is limited by Tune through `max_concurrent_trials`."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if settings.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=settings.seed)
    return BasicVariantGenerator(random_state=settings.seed, max_concurrent=concurrent)


class _Progress:
    """Tune callback: one console line per evaluation a trial reports, and per trial that ends. A
    trial that ends (stopped, failed) has its workers' placement group removed: its driver was
    stopped with the trial actor, and a placement group outlives the actor that made it. Tune
    pickles it into its state: it holds no storage options (see tune/credentials.py)."""

    def __new__(cls, say: Callable[[str], None], steps: int, metric: str, out: str) -> Any:
        from ray.tune import Callback

        from petatrain.runtime.cluster import remove_placement_groups

        def release(trial: Any) -> None:
            events = _events(trial_dir(out, trial.trial_id), credentials.held(out))
            groups = {e.placement_group for e in events if isinstance(e, ev.WorkerStart) and e.placement_group}
            remove_placement_groups(groups, f"of trial {trial.trial_id}: the trial ended")

        class Progress(Callback):
            def on_trial_result(self, iteration, trials, trial, result, **info):
                value = result.get(metric)
                shown = f"{value:.4f}" if isinstance(value, int | float) else "-"
                say(f"trial {trial.trial_id}: step {result.get('step')}/{steps}, {metric} {shown}")

            def on_trial_complete(self, iteration, trials, trial, **info):
                last = (trial.last_result or {}).get("step")
                how = "finished" if last == steps else f"stopped by the scheduler at step {last}"
                say(f"trial {trial.trial_id}: {how}")
                release(trial)

            def on_trial_error(self, iteration, trials, trial, **info):
                say(f"trial {trial.trial_id}: failed ({trial.num_failures} failure(s)); see {trial.path}")
                release(trial)

        return Progress()


def _conclude(
    base: JobConfig,
    grid: Any,
    out: str,
    options: StorageOptions | None,
    parsed: list[spaces.Space],
    steps: int,
    concurrent: int,
    wall_s: float,
) -> dict[str, Any]:
    """Reports per trial, stopped trials' end events, best.yaml, tune.json and tune.html."""
    from petatrain.observe.report import write_report, write_search_report

    settings = base.tune
    sign = 1 if settings.mode == "min" else -1
    trials, decisions = [], []
    for result in grid:
        metrics = result.metrics or {}
        trial_id = metrics.get("trial_id") or os.path.basename(str(result.path)).split("_")[-2:]
        trial_id = trial_id if isinstance(trial_id, str) else "_".join(trial_id)
        run_url = trial_dir(out, trial_id)
        events = _events(run_url, options)
        curve = _curve(events, result.metrics_dataframe, settings.metric)
        # The trial's own ledger says where its run got to, not Tune's last saved state: a search
        # resumed after its driver died restores each trial's result as of Tune's last save, and a
        # run that finished since then reports nothing new when Tune calls it again.
        step, value, finished = _outcome(events, curve, metrics, settings.metric, steps)
        status = "finished" if finished else "error" if result.error else "stopped"
        if status == "stopped":
            decisions.append({"trial": trial_id, "step": step, "decision": "stopped", "by": settings.scheduler})
            _record_stop(run_url, events, step, settings.scheduler, options)
        for e in events:
            if isinstance(e, ev.RunContinue) and e.source:
                source = e.source
                decisions.append(
                    {"trial": trial_id, "step": source["step"], "decision": "exploit", "from": source["from"]}
                )
        goodput = None
        if events:
            try:
                goodput = write_report(run_url, options)["goodput"]
            except PetatrainError as exc:
                log.warning("no report for trial %s: %s", trial_id, exc)
        trials.append(
            {
                "trial": trial_id,
                "params": {k: result.config.get(k) for k in (s.key for s in parsed)},
                settings.metric: value,
                "step": step,
                "status": status,
                "goodput": goodput,
                "startup_s": metrics.get("startup_s"),
                "run": run_url,
                "curve": curve,
                "error": str(result.error).strip().splitlines()[-1] if result.error else None,
            }
        )
    scores = {t["trial"]: float(v) for t in trials if isinstance(v := t[settings.metric], int | float) and v == v}
    best = min((t for t in trials if t["trial"] in scores), key=lambda t: sign * scores[t["trial"]], default=None)
    summary: dict[str, Any] = {
        "out": out,
        "metric": settings.metric,
        "mode": settings.mode,
        "scheduler": settings.scheduler,
        "search": settings.search,
        "steps": steps,
        "concurrent": concurrent,
        "wall_s": wall_s,
        "params": {s.key: str(s) for s in parsed},
        "trials": sorted(trials, key=lambda t: t["trial"]),
        "decisions": decisions,
        "best": None,
    }
    if best is not None:
        summary["best"] = {"trial": best["trial"], settings.metric: best[settings.metric], "params": best["params"]}
        summary["best_config"] = join(out, BEST_FILE)
        atomic_write(summary["best_config"], _best_yaml(base, best, steps).encode(), options)
    atomic_write(join(out, SUMMARY_FILE), (json.dumps(summary, indent=2, default=str) + "\n").encode(), options)
    summary["html"] = write_search_report(summary, join(out, HTML_FILE), options)
    return summary


def _outcome(
    events: list[ev.Event], curve: list[list[Any]], tuned: dict[str, Any], metric: str, steps: int
) -> tuple[int | None, Any, bool]:
    """(step, metric value, finished) of a trial: its run's last evaluation and whether the run
    ended ok at its last step, from the run's ledger; what Tune last recorded where the ledger
    has no evaluation (a run that never got to one)."""
    evals = [e.step for e in events if isinstance(e, ev.Eval)]
    if not evals:
        step = int(tuned["step"]) if tuned.get("step") is not None else None
        return step, tuned.get(metric), False
    step = max(evals)  # a run that went back (a branch) evaluates its steps again: the last one counts
    if metric == "eval_loss":
        value: Any = next((v for s, v in reversed(curve) if s == step), None)
    elif tuned.get("step") == step:
        value = tuned.get(metric)
    else:  # train_loss: the loss of the step evaluated, as the trial reported it
        value = next((e.loss for e in reversed(events) if isinstance(e, ev.Step) and e.step == step), None)
    last = _last_driver_event(events)
    finished = isinstance(last, ev.End) and last.status == "ok" and last.step == steps
    return step, value, finished


def _last_driver_event(events: list[ev.Event]) -> ev.Event | None:
    """The run's latest start, continuation or end: whether its last driver ended, and how."""
    return next((e for e in reversed(events) if isinstance(e, ev.End | ev.RunStart | ev.RunContinue)), None)


def _curve(events: list[ev.Event], history: Any, metric: str) -> list[list[Any]]:
    """[step, value] of each evaluation. eval_loss comes from the trial's ledger: every driver of
    its run, a step evaluated again after a fault counted once, and [None, None] where a PBT
    exploit made the run continue from another trial's state (the line breaks there). Tune's
    history has the other metrics (a trial restored by Tune keeps only what came since)."""
    if metric != "eval_loss":
        if history is None or "step" not in history:
            return []
        pairs = zip(history["step"], history[metric], strict=False)
        return [[int(s), float(v)] for s, v in pairs if v == v]  # NaN: not reported
    curve: list[list[Any]] = []
    at: dict[int, int] = {}  # step -> its index in the current segment
    for e in events:
        if isinstance(e, ev.RunContinue) and e.source and curve:
            curve.append([None, None])
            at = {}
        elif isinstance(e, ev.Eval):
            step, point = e.step, [e.step, e.loss]
            if step in at:
                curve[at[step]] = point
            else:
                at[step] = len(curve)
                curve.append(point)
    return curve


def _events(run_url: str, options: StorageOptions | None) -> list[ev.Event]:
    try:
        return typed_events(run_url, options)
    except FileNotFoundError:
        return []


def _record_stop(run_url: str, events: list[ev.Event], step: int | None, by: str, options: Any) -> None:
    """The ledger of a trial the scheduler stopped ends saying so (its driver was stopped with it)."""
    last = _last_driver_event(events)
    if last is None or isinstance(last, ev.End):
        return
    ledger = EventLog(run_url, options)
    try:
        detail = f"stopped by the search's {by} scheduler at step {step}"
        ledger.write_event(ev.End(status="stopped", step=step, detail=detail))
    finally:
        ledger.close()


def _best_yaml(base: JobConfig, best: dict[str, Any], steps: int) -> str:
    """The best trial's config as `train` runs it: the base with its parameters and step count."""
    import yaml

    setup = TrialSetup(base=base, out="", keys=tuple(best["params"]), steps=steps, checkpoints=False)
    cfg = configure(setup, best["params"])
    values = cfg.to_dict()
    values.pop("tune")
    header = (
        f"# The best trial of a petatrain search: trial {best['trial']} ({best['run']}).\n"
        f"#   petatrain train {BEST_FILE} --run-dir RUN\n"
    )
    return header + yaml.safe_dump(values, sort_keys=False)
