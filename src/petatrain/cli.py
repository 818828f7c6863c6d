"""`petatrain` command line: parse, call `petatrain.api`, render (rich tables or --json)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from petatrain import api, render
from petatrain import config as config_mod
from petatrain import console as quiet
from petatrain.render import out

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="petatrain: ingest, stream and train on petabyte-scale data.",
)
console = Console(stderr=True)

DEMO_ROOT = ".petatrain"


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:
        if os.environ.get("PETATRAIN_DEBUG"):
            raise
        _fail(*quiet.explain(exc))


def _say(line: str) -> None:
    """A progress line on stderr (markup allowed)."""
    console.print(line, highlight=False, soft_wrap=True)


_json_out: Any = None  # where --json's object goes once `_claim_stdout` moved everything else


def _claim_stdout(as_json: bool) -> None:
    """With --json, stdout carries one JSON object. Commands that run Ray call this first: from
    then on, to the end of the process, whatever is written to file descriptor 1 (Ray's log
    forwarding, also at exit; the processes Ray starts; print) goes to stderr, and the object
    goes to the original stdout."""
    global _json_out
    if not as_json or _json_out is not None:
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured): nothing to move
        return
    sys.stdout.flush()
    _json_out = os.fdopen(os.dup(fd), "w")
    os.dup2(sys.stderr.fileno(), fd)


def _print_json(obj: Any) -> None:
    stream = _json_out or sys.stdout
    stream.write(json.dumps(obj, indent=2, default=str) + "\n")
    stream.flush()


@app.callback()
def main(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log progress details, and show Ray's own output.")
    ] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet.set_verbose(verbose)


Sets = Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Address = Annotated[str, typer.Option(help="Ray cluster address (default: start a local Ray).")]
StorageConfig = Annotated[Path | None, typer.Option(help="Job config YAML; its storage section is used.")]


@app.command()
def ingest(
    sources: Annotated[list[str], typer.Argument(help="Files, folders, globs or URLs (s3://...) to ingest.")],
    out_: Annotated[str, typer.Option("--out", help="Dataset URL or path to write.")],
    fmt: Annotated[
        str | None, typer.Option("--format", help="auto|jsonl|parquet|csv|text|webdataset|tfrecord (default: auto)")
    ] = None,
    text_field: Annotated[
        str | None,
        typer.Option(help="Field (column, member extension, TFRecord feature) holding the text. (default: text)"),
    ] = None,
    dedup: Annotated[str | None, typer.Option(help="none|exact|near (default: near)")] = None,
    near_threshold: Annotated[
        float | None,
        typer.Option(help="Jaccard similarity over word 5-grams that counts as a near duplicate. (default: 0.8)"),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="bytes | train:VOCAB | path/to/tokenizer.json (default: keep text only).")
    ] = None,
    pack_length: Annotated[
        int | None, typer.Option(help="Pack tokens into rows of this many tokens (0: no). (default: 0)")
    ] = None,
    shard_size: Annotated[str | None, typer.Option(help="Target shard size, e.g. 256MB. (default: 256MB)")] = None,
    split_size: Annotated[
        str | None,
        typer.Option(
            help="Read JSONL, text and unquoted CSV files over this size as pieces in parallel; 0: never. "
            "(default: 256MB)"
        ),
    ] = None,
    max_chars: Annotated[int | None, typer.Option(help="Reject records longer than this. (default: 1000000)")] = None,
    fields: Annotated[
        str | None,
        typer.Option(
            help="Source fields kept as columns beside the text: a,b (those), * (every one), '' (none). (default: *)"
        ),
    ] = None,
    drop_fields: Annotated[str | None, typer.Option(help="Source fields not kept: c,d (every other one is).")] = None,
    append: Annotated[bool, typer.Option("--append", help="Add new source files to an existing dataset.")] = False,
    register: Annotated[bool, typer.Option("--register", help="Index existing Parquet files in place.")] = False,
    refresh: Annotated[
        bool,
        typer.Option(
            "--refresh", help="With --register: make the index exactly the folder's current files (after a rewrite)."
        ),
    ] = False,
    encrypt: Annotated[
        str | None,
        typer.Option(
            "--encrypt",
            metavar="KEYREF",
            help="Encrypt the shards (Parquet modular encryption) with these keys (file:PATH or barbican+https://...): "
            "shorthand for --set storage.encryption.key=KEYREF.",
        ),
    ] = None,
    address: Address = "",
    local_cpus: Annotated[int, typer.Option(help="CPUs for the local Ray (0: all); ignored with --address.")] = 0,
    config: Annotated[
        Path | None, typer.Option(help="Job config YAML; its ingest and storage sections are used.")
    ] = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Ingest raw files into a clean, deduplicated, sharded Parquet dataset (on Ray Data).

    Settings come from the config's `ingest:` section; a flag you give overrides it, and --set overrides both."""
    given = {
        "format": fmt,
        "text_field": text_field,
        "dedup": dedup,
        "near_threshold": near_threshold,
        "tokenizer": tokenizer,
        "pack_length": pack_length,
        "shard_size": shard_size,
        "split_size": split_size,
        "max_chars": max_chars,
        "fields": fields,
        "drop_fields": drop_fields,
    }

    def go():
        _claim_stdout(as_json)
        flags = [f"ingest.{k}={json.dumps(v)}" for k, v in given.items() if v is not None]
        if encrypt is not None:
            flags.append(f"storage.encryption.key={json.dumps(encrypt)}")
        job_cfg = config_mod.load(config, flags + list(set_ or []))
        api.use_ray_tls(job_cfg)  # before anything loads Ray
        logs = quiet.quiet_ray()
        summary = api.ingest(
            sources,
            out_,
            config=job_cfg.ingest,
            append=append,
            register=register,
            refresh=refresh,
            address=address or job_cfg.resources.address,
            local_cpus=local_cpus,
            options=job_cfg.storage.options(),
            on_stage=None if as_json else quiet.IngestProgress(_say),
        )
        if logs:
            logs.finish("petatrain-ingest.log")
        if as_json:
            _print_json(summary.to_dict())
        else:
            render.ingest(summary.to_dict())

    _guarded(go)


@app.command()
def inspect(
    dataset: Annotated[str, typer.Argument(help="Dataset URL or path.")],
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every shard; fail naming each bad one.")] = False,
    samples: Annotated[int, typer.Option(help="Sample rows to show.")] = 3,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Show a dataset's schema, counts and sample rows; --verify checks every shard."""

    def go():
        options = config_mod.load(config, list(set_ or [])).storage.options()
        report = api.inspect(dataset, options=options, verify=verify, samples=samples)
        if as_json:
            _print_json(report.to_dict())
        else:
            render.inspect(report.to_dict())
        if verify and report.problems:
            for line in report.problems:
                console.print(f"[red]{escape(line)}[/red]", highlight=False, soft_wrap=True)
            _fail(f"{len(report.problems)} of {report.shards} shards missing or corrupt", 1)

    _guarded(go)


@app.command()
def demo(
    root: Annotated[str, typer.Option(help="Where the demo corpus, dataset and run go.")] = DEMO_ROOT,
    documents: Annotated[int, typer.Option(help="Unique documents to generate.")] = 3000,
    train_: Annotated[bool, typer.Option("--train/--no-train", help="End with the training demo.")] = True,
    as_json: Json = False,
) -> None:
    """Generate a corpus with duplicates and bad records, ingest it, stream it with 2 ranks
    resuming half-way with 3, then train a small GPT on 2 workers through a worker kill."""

    def go():
        _claim_stdout(as_json)
        corpus_dir = os.path.join(root, "demo-corpus")
        dataset = os.path.join(root, "datasets", "demo")
        if not os.path.isdir(corpus_dir):
            _say(f"generating a synthetic corpus in {corpus_dir}")
            api.synthetic_corpus(corpus_dir, documents=documents, files=4)
        # Byte tokens packed into rows of 65 (64 inputs + 1 target), in shards small enough
        # that the last one can be held out for evaluation.
        ingest_cfg = config_mod.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="1MB")
        logs = quiet.quiet_ray()
        on_stage = None if as_json else quiet.IngestProgress(_say)
        summary = api.ingest([corpus_dir], dataset, config=ingest_cfg, on_stage=on_stage)
        report = api.inspect(dataset, verify=True, samples=1)
        stream = api.check_resume(dataset)
        result = {"ingest": summary.to_dict(), "inspect": report.to_dict(), "stream": stream.to_dict()}
        if not as_json:
            render.ingest(summary.to_dict())
            render.inspect(report.to_dict())
            render.stream(stream.to_dict())
        if not stream.exactly_once:
            _fail("the loader did not deliver every sample exactly once", 1)
        if train_:
            result["train"] = _demo_train(root, dataset, as_json, logs)
        elif logs:
            logs.finish("petatrain-demo.log")
        if as_json:
            _print_json(result)
            return
        run = result.get("train", {}).get("run", "")
        out.print(f"\nNext: [bold].venv/bin/petatrain report {run}[/bold]")
        out.print(f"      [bold].venv/bin/petatrain serve {run}[/bold]  (its model over HTTP; README, Serving)")

    _guarded(go)


def _demo_train(root: str, dataset: str, as_json: bool, logs: quiet.RayLogs | None) -> dict[str, Any]:
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
    cfg = config_mod.load(example if example.exists() else None, [f"data.dataset={dataset}"])
    run_dir = os.path.join(root, "runs", "demo")
    api.remove_run(run_dir)  # a fresh run each time: resuming a finished run would train nothing
    if not as_json:
        out.print(f"\n[bold]training[/bold] a {cfg.model.n_layer}-layer GPT on 2 workers; rank 1 is killed at step 17")
    result = _run_training(cfg, run_dir, "", ["kill@step=17,rank=1"], as_json, logs)
    samples = api.sample(cfg, result.run, ["the ", "data "], new_tokens=60)
    if not as_json:
        _render_training(result)
        for text in samples:
            out.print(f"[bold]sample[/bold] {text!r}", highlight=False)
    return {**result.fields, "goodput": result.report.goodput, "samples": samples}


def _run_training(
    cfg: config_mod.JobConfig,
    run_dir: str,
    address: str,
    specs: list[str],
    as_json: bool,
    logs: quiet.RayLogs | None,
    stop_after_s: float | None = None,
    resume: bool = False,
    branch: str | None = None,
) -> api.TrainResult:
    """api.train with progress on the console, and Ray's driver log in RUN/logs once the run exists."""
    targets = api.metrics_targets_path(run_dir, cfg.storage.options())
    progress = quiet.TrainProgress(_say, total_steps=cfg.train.steps, targets=targets)
    log_path = api.driver_log_path(run_dir, cfg.storage.options())

    def on_event(event: dict[str, Any]) -> None:
        if logs and log_path and event.get("event") in ("run_start", "run_continue"):  # the run holds its folder
            logs.attach(log_path)
        if not as_json:
            progress(event)

    result = api.train(
        cfg,
        run_dir=run_dir,
        address=address,
        injections=specs,
        on_event=on_event,
        stop_after_s=stop_after_s,
        resume=resume,
        branch=branch,
    )
    if logs:
        result = dataclasses.replace(result, ray_log=logs.finish("petatrain-driver.log"))
    return result


def _render_training(result: api.TrainResult) -> None:
    out.print(f"trained {result.steps} steps in {result.wall_s:.1f}s, {result.attempts} attempt(s)", highlight=False)
    for f in result.failures:
        rank = "" if f.rank is None else f" (rank {f.rank})"
        out.print(f"  recovered from {f.cause}{rank}", highlight=False)
    render.report(result.report.to_dict())
    if result.failures and result.ray_log:
        out.print(
            f"Ray's own logs: {result.ray_log}; workers': {quiet.RAY_SESSION_LOGS}", highlight=False, soft_wrap=True
        )


@app.command("config")
def show_config(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (default: built-in defaults).")] = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Print the resolved job config (YAML + --set overrides), or the error naming a bad key."""

    def go():
        cfg = config_mod.load(config, list(set_ or []))
        if as_json:
            _print_json(cfg.to_dict())
        else:
            sys.stdout.write(cfg.to_yaml())

    _guarded(go)


RunDir = Annotated[str | None, typer.Option("--run-dir", help="Run directory (local path or s3://...).")]
Injects = Annotated[
    list[str] | None, typer.Option("--inject", help="Fault to inject, e.g. kill@step=17,rank=1 (repeatable).")
]


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="Job config YAML (examples/tiny.yaml).")],
    set_: Sets = None,
    run_dir: RunDir = None,
    address: Address = "",
    inject: Injects = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the run --run-dir holds (same run, next attempt, newest checkpoint); "
            "starts it if the folder is new. A RayJob's entrypoint uses it.",
        ),
    ] = False,
    branch: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Start from another run's checkpoint, RUN or RUN@STEP (its newest, or of step STEP): "
            "weights, optimizer, loader position and RNG, trained on with this config (a new lr, more steps).",
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """Train on Ray Train (DDP or FSDP), checkpointing asynchronously and recovering from faults."""
    _guarded(
        lambda: _train(
            config, list(set_ or []), run_dir, address, list(inject or []), as_json, resume=resume, branch=branch
        )
    )


@app.command("tune")
def tune_cmd(
    config: Annotated[Path, typer.Argument(help="Job config YAML each trial trains (its tune: section, if any).")],
    out: Annotated[str, typer.Option("--out", help="Folder of the search: trials/, best.yaml, tune.html.")],
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            help="KEY=SPACE, e.g. train.lr=loguniform:1e-4:1e-2, model.d_model=choice:64,128, "
            "train.warmup_steps=randint:0:20, train.weight_decay=uniform:0:0.1 (repeatable).",
        ),
    ] = None,
    trials: Annotated[int | None, typer.Option(help="Trials to run (tune.trials).")] = None,
    scheduler: Annotated[str | None, typer.Option(help="asha, pbt or none (tune.scheduler).")] = None,
    search: Annotated[str | None, typer.Option(help="random or optuna (tune.search).")] = None,
    metric: Annotated[str | None, typer.Option(help="eval_loss or train_loss (tune.metric).")] = None,
    mode: Annotated[str | None, typer.Option(help="min or max (tune.mode).")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Steps per trial (tune.max_steps; 0: train.steps).")] = None,
    concurrent: Annotated[
        int | None, typer.Option(help="Trials at once (tune.concurrent; default: as many as the cluster holds).")
    ] = None,
    set_: Sets = None,
    address: Address = "",
    inject: Injects = None,
    as_json: Json = False,
) -> None:
    """Search hyperparameters on Ray Tune: every trial a fault-tolerant training run, ASHA or PBT.

    Run it again with the same arguments on the same --out to resume an interrupted search."""

    def go():
        flags = {
            "trials": trials, "scheduler": scheduler, "search": search, "metric": metric, "mode": mode,
            "max_steps": max_steps, "concurrent": concurrent,
        }  # fmt: skip
        overrides = list(set_ or []) + [f"tune.{k}={v}" for k, v in flags.items() if v is not None]
        cfg = config_mod.load(config, overrides)
        _claim_stdout(as_json)
        api.use_ray_tls(cfg)  # before anything loads Ray
        logs = quiet.quiet_ray()
        summary = api.tune(
            cfg,
            out,
            params=list(param or []),
            address=address,
            injections=list(inject or []),
            on_progress=None if as_json else _say,
        )
        if logs:
            logs.finish("petatrain-tune.log")
        if as_json:
            _print_json(summary)
        else:
            render.search(summary)

    _guarded(go)


@app.command()
def chaos(
    config: Annotated[Path, typer.Argument(help="Job config YAML.")],
    set_: Sets = None,
    run_dir: RunDir = None,
    address: Address = "",
    inject: Injects = None,
    every: Annotated[str, typer.Option("--every", help="Soak: a random fault this often, e.g. 120s.")] = "",
    duration: Annotated[str, typer.Option("--for", help="Soak: for this long, e.g. 20m.")] = "",
    seed: Annotated[int, typer.Option(help="Soak: seed of the random fault kinds and ranks.")] = 0,
    as_json: Json = False,
) -> None:
    """Train with injected faults (--inject ... or a random soak), then print the goodput report."""

    def go():
        specs, stop_after = list(inject or []), None
        if every or duration:
            cfg = config_mod.load(config, list(set_ or []))
            soak, stop_after = api.soak_schedule(cfg, every=every, duration=duration, seed=seed)
            specs += soak
        _train(config, list(set_ or []), run_dir, address, specs, as_json, stop_after_s=stop_after)

    _guarded(go)


def _train(
    config,
    overrides,
    run_dir,
    address,
    specs,
    as_json,
    stop_after_s: float | None = None,
    resume: bool = False,
    branch: str | None = None,
) -> None:
    import time

    cfg = config_mod.load(config, overrides)
    run_url = run_dir or os.path.join(DEMO_ROOT, "runs", time.strftime("%Y%m%d-%H%M%S"))
    _claim_stdout(as_json)
    api.use_ray_tls(cfg)  # before anything loads Ray
    logs = quiet.quiet_ray()
    result = _run_training(cfg, run_url, address, specs, as_json, logs, stop_after_s, resume, branch)
    if as_json:
        _print_json(result.to_dict())
        return
    _render_training(result)
    out.print(f"final weights: {result.final}", highlight=False)


@app.command()
def report(
    run: Annotated[str, typer.Argument(help="Run directory URL or path (holds events.jsonl).")],
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (report.json).")] = False,
) -> None:
    """Goodput of a run: where its wall time went, its faults, loss curve and timeline (PNG + HTML)."""

    def go():
        options = config_mod.load(config, list(set_ or [])).storage.options()
        written = api.report(run, options=options)
        if as_json:
            _print_json(written.to_dict())
        else:
            render.report(written.to_dict())

    _guarded(go)


@app.command("serve")
def serve_cmd(
    run: Annotated[str, typer.Argument(help="Run directory URL or path (holds config.yaml and its weights).")],
    checkpoint: Annotated[str, typer.Option(help="final, latest, or a checkpoint's step.")] = "final",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback unless told otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8000,
    replicas: Annotated[str | None, typer.Option(help="Replicas: N, or MIN-MAX to autoscale (serve.replicas).")] = None,
    max_batch: Annotated[int | None, typer.Option(help="Requests completed together (serve.max_batch).")] = None,
    follow: Annotated[bool, typer.Option(help="With --checkpoint latest: switch to each new checkpoint.")] = False,
    set_: Sets = None,
    address: Address = "",
    as_json: Json = False,
) -> None:
    """Serve a trained run's model with Ray Serve: POST /v1/completions, GET /v1/models, GET /healthz.

    The weights are checked against what the run committed before anything is served. The run's
    `serve:` config sets replicas, batching and autoscaling; the flags and --set serve.KEY=VALUE
    override it. Runs until Ctrl-C."""

    def go():
        import time

        overrides = list(set_ or [])
        overrides += [f"serve.replicas={replicas}"] if replicas is not None else []
        overrides += [f"serve.max_batch={max_batch}"] if max_batch is not None else []
        serving = api.serve(
            run, checkpoint=checkpoint, host=host, port=port, address=address, follow=follow, overrides=overrides
        )
        if as_json:
            _print_json(serving.to_dict())
        else:
            m = serving.model
            _say(f"serving {m['run']} ({m['source']}, step {m['step']}, {m['checksum']}) at {serving.url}")
            _say(f'  curl {serving.url}/v1/completions -d \'{{"prompt": "Once", "max_tokens": 32}}\'')
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            _say("stopping")
        finally:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C while the replicas stop
                api.stop_serving()

    _guarded(go)


@app.command("plan")
def plan_cmd(
    config: Annotated[
        Path | None, typer.Argument(help="Job config YAML (model, train, parallel, plan sections).")
    ] = None,
    accelerator: Annotated[str, typer.Option(help="Only this catalog accelerator (default: all).")] = "",
    count: Annotated[int, typer.Option(help="Only this many devices (default: powers of two).")] = 0,
    max_count: Annotated[int, typer.Option(help="Largest device count to consider.")] = 1024,
    budget: Annotated[
        float, typer.Option(help="Budget in USD (on-demand); with no deadline: fastest within it.")
    ] = 0.0,
    deadline: Annotated[float, typer.Option(help="Deadline in hours: cheapest candidate that finishes in time.")] = 0.0,
    mtbf_hours: Annotated[
        float, typer.Option(help="Mean time between failures per node (default faults.mtbf_hours).")
    ] = 0.0,
    show: Annotated[int, typer.Option(help="Rows of the candidates table (the best runnable first).")] = 12,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Estimate memory, FLOPs, step time, goodput, time and cost on every accelerator, count and
    strategy; recommend one and say why each other candidate lost."""

    def go():
        if count < 0 or max_count < 1 or budget < 0 or deadline < 0 or mtbf_hours < 0:
            _fail("--count, --budget, --deadline and --mtbf-hours must be >= 0 and --max-count >= 1")
        cfg = config_mod.load(config, list(set_ or []))
        result = api.plan(
            cfg,
            accelerator=accelerator,
            count=count,
            max_count=max_count,
            budget_usd=budget,
            deadline_hours=deadline,
            mtbf_hours=mtbf_hours,
        ).to_dict()
        if as_json:
            _print_json(result)
        else:
            render.plan(result, show)
        if result["recommended"] is None:
            _fail(f"no candidate is {result['objective']}; see the reasons above (or --json)", 1)

    _guarded(go)


@app.command("profile")
def profile_cmd(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (model and train sections).")] = None,
    steps: Annotated[int, typer.Option(help="Measured training steps (after one warm-up step).")] = 5,
    dataset: Annotated[
        bool, typer.Option("--dataset", help="Read batches from data.dataset instead of random tokens.")
    ] = False,
    save: Annotated[bool, typer.Option(help="Save the calibration that later plan runs use.")] = True,
    layers: Annotated[
        bool,
        typer.Option(
            "--layers",
            help="Measure each unit (embedding, blocks, head) and the link between two ranks instead: "
            "what parallel.pipeline.partition profile cuts by; prints each partition's predicted stages.",
        ),
    ] = False,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Run real training steps on this machine, measure memory, time split and FLOP/s, compare
    each figure with the plan's estimate, and save a calibration for plan."""

    def go():
        if steps < 1:
            _fail("--steps must be >= 1")
        cfg = config_mod.load(config, list(set_ or []))
        if layers:
            measured = api.profile_layers(cfg, repetitions=steps, save=save)
            _print_json(measured) if as_json else render.layers(measured)
            return
        report = api.profile(cfg, steps=steps, use_dataset=dataset, save=save)
        if as_json:
            _print_json(report.to_dict())
        else:
            render.profile(report.to_dict())

    _guarded(go)


keys_app = typer.Typer(
    no_args_is_help=True,
    help="Keys (a keyring file or a Barbican container: create, export the public half, rotate) and Ray's TLS "
    "certificates.",
)
app.add_typer(keys_app, name="keys")


@keys_app.command("create")
def keys_create(
    path: Annotated[
        str,
        typer.Argument(
            help="Where to write the keyring (a new file; mode 0600), or a Barbican service "
            "(barbican+https://HOST:PORT) to make a key container in."
        ),
    ],
    as_json: Json = False,
) -> None:
    """New keys: a master key for wrapping data keys and an Ed25519 signing pair.

    In a local keyring file, used as `storage.encryption.key: file:PATH` (or `ingest --encrypt file:PATH`);
    or in a new OpenStack Barbican container (the master key generated by Barbican; credentials from
    OS_AUTH_TOKEN or OS_PROJECT_ID), used as the KEYREF this prints."""

    def go():
        made = api.create_keys(path)
        if as_json:
            _print_json(made)
        else:
            where = "keyring" if made["keyref"].startswith("file:") else "key container"
            mode = " (mode 0600)" if where == "keyring" else ""
            out.print(
                f"{where} {made['keyref']}{mode}: master key version {made['primary']}, signing key {made['key_id']}",
                highlight=False,
                soft_wrap=True,
            )

    _guarded(go)


@keys_app.command("public")
def keys_public(
    keyref: Annotated[str, typer.Argument(help="KEYREF of the keys (file:PATH or barbican+https://...).")],
    out_path: Annotated[str, typer.Option("--out", help="Where to write the verification key.")],
    as_json: Json = False,
) -> None:
    """Write the keyring's public signing key alone, for readers that verify but neither sign nor decrypt.

    Give it to them as `storage.signing.key` (with `storage.signing.verify: true`)."""

    def go():
        made = api.export_public_key(keyref, out_path)
        _print_json(made) if as_json else out.print(f"verification key {made['key_id']} -> {made['path']}")

    _guarded(go)


@keys_app.command("rotate")
def keys_rotate(
    keyref: Annotated[str, typer.Argument(help="KEYREF of the keys (file:PATH or barbican+https://...).")],
    targets: Annotated[
        list[str] | None, typer.Argument(help="Datasets and runs whose data keys to re-wrap with the new version.")
    ] = None,
    retire: Annotated[
        bool,
        typer.Option(
            "--retire",
            help="Then drop the older master key versions: anything not re-wrapped here can no longer be read.",
        ),
    ] = False,
    as_json: Json = False,
) -> None:
    """Add a master key version and re-wrap the data keys of the given datasets and runs with it.

    Only the small records holding wrapped keys are rewritten (a manifest, each checkpoint's
    COMMITTED, the final weights' record); no shard or checkpoint file is."""

    def go():
        done = api.rotate_keys(keyref, list(targets or []), retire=retire)
        if as_json:
            _print_json(done)
            return
        out.print(f"{keyref}: master key version {done['key_version']} is now primary", highlight=False)
        for item in done["rewrapped"]:
            what = item.get("dataset") or item.get("run")
            rest = {k: v for k, v in item.items() if k not in ("dataset", "run")}
            out.print(f"  re-wrapped {what}: {json.dumps(rest)}", highlight=False, soft_wrap=True)
        if done["retired"]:
            out.print(f"  retired versions {', '.join(map(str, done['retired']))}", highlight=False)

    _guarded(go)


@keys_app.command("tls")
def keys_tls(
    folder: Annotated[str, typer.Argument(help="An empty folder for ca.pem, ca.key, node.pem, node.key.")],
    hosts: Annotated[
        list[str] | None, typer.Option("--host", help="A node's address or name (repeatable; localhost is always in).")
    ] = None,
    as_json: Json = False,
) -> None:
    """Certificates for Ray's TLS: a new CA and a node certificate for the --host addresses.

    Prints the settings: `resources.tls.*` for petatrain, the RAY_TLS_* variables for each node's `ray start`."""

    def go():
        made = api.make_ray_tls(folder, list(hosts or []))
        if as_json:
            _print_json(made)
            return
        out.print(f"wrote {made['folder']}: ca.pem, node.pem, and keys ca.key, node.key (mode 0600)", highlight=False)
        out.print("job config:", highlight=False)
        for key, value in made["config"].items():
            out.print(f"  resources.tls.{key}: {value}", highlight=False, soft_wrap=True)
        out.print("every node, before `ray start`:", highlight=False)
        out.print("  export " + " ".join(f"{k}={v}" for k, v in made["env"].items()), highlight=False, soft_wrap=True)

    _guarded(go)


# -- access: least-privilege policies for the ingest, train and serve identities (issue 22) --------
access_app = typer.Typer(no_args_is_help=True, help="S3 access for the ingest, train and serve identities.")
app.add_typer(access_app, name="access")


@access_app.command("policy")
def access_policy(
    role: Annotated[str, typer.Option(help="ingest | train | serve")],
    bucket: Annotated[str, typer.Option(help="The bucket the policy is for.")],
    prefix: Annotated[
        str, typer.Option(help="Datasets prefix: ingest writes it, train reads it, serve reads only its tokenizers.")
    ] = "",
    run_prefix: Annotated[
        str, typer.Option(help="train: the run it writes; serve: the run whose committed models it reads.")
    ] = "",
    source: Annotated[
        list[str] | None, typer.Option("--source", help="ingest: an s3:// source it reads (repeatable).")
    ] = None,
    principal: Annotated[
        str, typer.Option(help="The identity's ARN: prints a bucket policy (else an IAM policy to attach to it).")
    ] = "",
    merge: Annotated[
        Path | None, typer.Option(help="A policy JSON file (the bucket's current one) to add these statements to.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the policy only, without the summary.")] = False,
) -> None:
    """Print the S3 policy (IAM JSON, 2012-10-17) that lets ROLE do exactly what it needs.

    ingest: read --source, read/write/list/delete under --prefix. train: read/list --prefix,
    read/write/list/delete only under --run-prefix, and never write the datasets. serve: read
    the run's config.yaml, final/ and checkpoints/ and the datasets' tokenizers; no shard, no write.
    Apply a bucket policy with `aws s3api put-bucket-policy --bucket B --policy file://policy.json`."""

    def go():
        from petatrain.errors import PetatrainError
        from petatrain.storage import access

        built = access.policy(
            role, bucket=bucket, prefix=prefix, run_prefix=run_prefix, sources=list(source or []), principal=principal
        )
        document = built.to_dict()
        if merge is not None:
            try:
                document = access.merge(json.loads(merge.read_text()), document)
            except (OSError, ValueError) as exc:
                raise PetatrainError(f"--merge {merge}: not a readable policy JSON file ({exc})") from None
        if not as_json:
            who = principal or "the identity this IAM policy is attached to"
            _say(f"[bold]{role}[/bold] ({who}) in s3://{built.bucket}:")
            for line in built.describe():
                _say(f"  {escape(line)}")
        _print_json(document)

    _guarded(go)


if __name__ == "__main__":  # pragma: no cover
    app()


deploy_app = typer.Typer(
    no_args_is_help=True, help="Run on Kubernetes: KubeRay manifests from a job config and its plan."
)
app.add_typer(deploy_app, name="deploy")


@deploy_app.command("k8s")
def deploy_k8s(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (not needed with --validate).")] = None,
    out_dir: Annotated[
        str, typer.Option("--out", help="Folder the manifests are written to (one YAML file each).")
    ] = "",
    run_dir: Annotated[
        str, typer.Option("--run-dir", help="The run directory on the object store (s3://...): what a retry continues.")
    ] = "",
    image: Annotated[str, typer.Option(help="Container image with petatrain installed.")] = "",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace.")] = "default",
    name: Annotated[
        str, typer.Option(help="Name of the RayJob/RayCluster/RayService (default: petatrain-CONFIG).")
    ] = "",
    accelerator: Annotated[str, typer.Option(help="Catalog accelerator (H100-SXM, ...); default: CPU pods.")] = "",
    count: Annotated[int, typer.Option(help="Accelerators (or CPU workers) to train on; default: the config's.")] = 0,
    from_plan: Annotated[
        bool, typer.Option("--from-plan", help="Size from `petatrain plan`'s recommendation.")
    ] = False,
    kind: Annotated[
        str, typer.Option(help="rayjob (train, then finish), raycluster (interactive) or rayservice (serve --run-dir).")
    ] = "rayjob",
    checkpoint: Annotated[
        str, typer.Option(help="rayservice: the checkpoint served: final, latest (follows new ones) or a step.")
    ] = "final",
    s3_secret: Annotated[
        str, typer.Option(help="Secret holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (default: NAME-s3).")
    ] = "",
    cache_size: Annotated[str, typer.Option(help="Size of each node's shard cache.")] = "100Gi",
    cache_storage_class: Annotated[
        str, typer.Option(help="Storage class for the shard cache (a PVC per pod); default: an emptyDir.")
    ] = "",
    validate: Annotated[
        str, typer.Option("--validate", help="Only check the manifests in this folder, offline; exit 1 on a problem.")
    ] = "",
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Write KubeRay manifests (a RayJob, RayCluster or RayService, with its ServiceAccount, ConfigMap and
    PodMonitor) sized from the config or its plan; a RayJob's retry continues the run. --validate DIR checks them."""

    def go():
        from petatrain.errors import ConfigError

        if validate:
            problems = api.validate_k8s(validate)
            if as_json:
                _print_json({"folder": validate, "problems": problems})
            for line in problems if not as_json else []:
                out.print(escape(line), highlight=False, soft_wrap=True)
            if problems:
                raise typer.Exit(1)
            if not as_json:
                out.print(f"{escape(validate)}: every manifest is valid", highlight=False, soft_wrap=True)
            return
        if config is None or not out_dir:
            raise ConfigError("deploy k8s needs a CONFIG and --out DIR (or --validate DIR)")
        if kind not in ("rayjob", "raycluster", "rayservice"):
            raise ConfigError(f"--kind {kind!r}: rayjob, raycluster or rayservice")
        from petatrain.deploy.manifests import Target, name_from

        cfg = config_mod.load(config, list(set_ or []))
        target = Target(
            name=name or name_from(str(config)), run_dir=run_dir or "", namespace=namespace, kind=kind,
            accelerator=accelerator, s3_secret=s3_secret, cache_size=cache_size, checkpoint=checkpoint,
            cache_storage_class=cache_storage_class, **({"image": image} if image else {}),
        )  # fmt: skip
        if kind != "raycluster" and not run_dir:
            raise ConfigError(
                f"--run-dir s3://BUCKET/runs/NAME: a {kind} trains into (or serves) a run directory on the object store"
            )
        done = api.deploy_k8s(cfg, target, out_dir, from_plan=from_plan, count=count)
        if as_json:
            _print_json(done.to_dict())
            return
        lo, hi = done.worker_pods
        pods = f"{lo}" if lo == hi else f"{lo}-{hi} (autoscaled)"
        per = f" x {done.devices_per_node} {done.accelerator}" if done.devices_per_node else " (CPU)"
        _say(f"{done.kind}: {pods} worker pod(s){per}, sized by {escape(done.sized_by)}")
        for path in done.files:
            _say(f"  {path}")
        _say(f"apply: kubectl apply -f {out_dir}   watch: kubectl get {done.kind} -n {namespace} -w")

    _guarded(go)
