"""`petatrain` command line: parse, call the API, render (rich tables or --json)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from petatrain import config as config_mod
from petatrain.errors import PetatrainError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="petatrain: ingest, stream and train on petabyte-scale data.",
)
console = Console(stderr=True)
out = Console()

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
        _fail(*_explain(exc))


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # Ray colours the task tracebacks it forwards
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_DEBUG_HINT = "PETATRAIN_DEBUG=1 shows the traceback"


def _explain(exc: Exception) -> tuple[str, int]:
    """The one line the CLI prints for `exc`, and the exit code: 2 for a PetatrainError, even
    one raised in a Ray task; 1, naming the exception and where it was raised, for any other."""
    cause = _cause(exc)
    if isinstance(cause, PetatrainError):
        return _one_line(str(cause)), 2
    if cause is not exc and cause.__traceback__ is None:
        # Raised in a Ray task: the exception came back pickled, its traceback only as text. Ray
        # Data wraps what a map raised in a UserCodeException, and pickling dropped __cause__,
        # so the text is all there is of it.
        found = _task_exception(str(exc))
        if found:
            what, where = found
            qualname, _, message = what.partition(": ")
            module, _, name = qualname.rpartition(".")
            raised = getattr(sys.modules.get(module), name, None)
            if isinstance(raised, type) and issubclass(raised, PetatrainError):
                return _one_line(message), 2
            return _unexpected(what, where), 1
    if type(cause).__module__.startswith("ray."):  # a process died, a node was lost...
        return f"Ray: {type(cause).__name__}: {_first_line(str(cause))} ({_DEBUG_HINT})", 1
    frames = traceback.extract_tb(cause.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return _unexpected(f"{type(cause).__name__}: {_first_line(str(cause))}", where), 1


def _cause(exc: BaseException) -> BaseException:
    """What to tell the user about `exc`: the first PetatrainError along its chain (through
    `raise ... from` and Ray's wrappers), else what a Ray task raised, else `exc`."""
    seen: set[int] = set()
    shown = None
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        inner = getattr(node, "cause", None)
        if isinstance(inner, BaseException):  # RayTaskError(X) is an X, but prints Ray's traceback
            node = inner
            continue
        if isinstance(node, PetatrainError):
            return node
        shown = shown or node
        node = node.__cause__
    return shown or exc


def _task_exception(text: str) -> tuple[str, str] | None:
    """("Type: message", "file:line in function") of the innermost exception in the text of a
    Ray task error, which lists it first: a header, its frames, its line, then any wrappers."""
    lines = _ANSI.sub("", text[:50_000]).split("\n\n")[0].splitlines()
    framed = [i for i, line in enumerate(lines) if _FRAME.search(line)]
    if not framed:
        return None
    what = next((line for line in lines[framed[-1] + 1 :] if line and not line[0].isspace()), "")
    file, line, function = _FRAME.search(lines[framed[-1]]).groups()
    return what, f"{os.path.basename(file)}:{line} in {function}"


def _unexpected(what: str, where: str) -> str:
    at = f" at {where}" if where else ""
    return f"unexpected {_one_line(what)}{at}: a bug in petatrain, or a file it read is corrupt ({_DEBUG_HINT})"


def _first_line(text: str) -> str:
    return next((line for line in _ANSI.sub("", text[:10_000]).splitlines() if line.strip()), "")


def _one_line(text: str, limit: int = 1000) -> str:
    """`text` without colour codes, its lines joined, at most `limit` characters."""
    line = " ".join(_ANSI.sub("", text[: 4 * limit]).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


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
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def ingest(
    sources: Annotated[list[str], typer.Argument(help="Files, folders, globs or URLs (s3://...) to ingest.")],
    out_: Annotated[str, typer.Option("--out", help="Dataset URL or path to write.")],
    fmt: Annotated[str, typer.Option("--format", help="auto|jsonl|parquet|csv|text|webdataset")] = "auto",
    text_field: Annotated[str, typer.Option(help="Field (column, member extension) holding the text.")] = "text",
    dedup: Annotated[str, typer.Option(help="none|exact|near")] = "near",
    near_threshold: Annotated[
        float, typer.Option(help="Jaccard similarity over word 5-grams that counts as a near duplicate.")
    ] = 0.8,
    tokenizer: Annotated[
        str, typer.Option(help="bytes | train:VOCAB | path/to/tokenizer.json (empty: keep text only).")
    ] = "",
    pack_length: Annotated[int, typer.Option(help="Pack tokens into rows of this many tokens (0: no).")] = 0,
    shard_size: Annotated[str, typer.Option(help="Target shard size, e.g. 256MB.")] = "256MB",
    max_chars: Annotated[int, typer.Option(help="Reject records longer than this.")] = 1_000_000,
    append: Annotated[bool, typer.Option("--append", help="Add new source files to an existing dataset.")] = False,
    register: Annotated[bool, typer.Option("--register", help="Index existing Parquet files in place.")] = False,
    address: Annotated[str, typer.Option(help="Ray cluster address (default: start a local Ray).")] = "",
    local_cpus: Annotated[int, typer.Option(help="CPUs for the local Ray (0: all); ignored with --address.")] = 0,
    config: Annotated[Path | None, typer.Option(help="Job config YAML; its storage section is used.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Ingest raw files into a clean, deduplicated, sharded Parquet dataset (on Ray Data)."""

    def go():
        from petatrain.data.ingest import IngestJob, run

        _claim_stdout(as_json)
        overrides = list(set_ or [])
        cli_values = {
            "format": fmt,
            "text_field": text_field,
            "dedup": dedup,
            "near_threshold": near_threshold,
            "tokenizer": tokenizer,
            "pack_length": pack_length,
            "shard_size": shard_size,
            "max_chars": max_chars,
        }
        overrides = [f"ingest.{k}={json.dumps(v)}" for k, v in cli_values.items()] + overrides
        job_cfg = config_mod.load(config, overrides)
        summary = run(
            IngestJob(
                sources=sources,
                out=out_,
                config=job_cfg.ingest,
                append=append,
                register=register,
                address=address or job_cfg.resources.address,
                local_cpus=local_cpus,
                options=job_cfg.storage.options(),
            )
        )
        if as_json:
            _print_json({k: v for k, v in summary.to_dict().items()})
        else:
            _render_ingest(summary.to_dict())

    _guarded(go)


def _render_ingest(s: dict[str, Any]) -> None:
    table = Table(title=f"ingest → {s['dataset']}", show_header=False)
    rate = s["input_bytes"] / max(s["seconds"], 1e-9) / 1e6
    for key, value in (
        ("records in", s["rows_in"]),
        ("rows out", s["rows_out"]),
        ("rejected", sum(s["rejected"].values())),
        ("exact duplicates", s["exact_duplicates"]),
        ("near duplicates", s["near_duplicates"]),
        ("shards written", s["shards"]),
        ("bytes written", s["bytes"]),
        ("new files", s["files_new"]),
        ("already ingested", s["files_already_ingested"]),
        ("seconds", f"{s['seconds']:.1f} ({rate:.1f} MB/s of input)"),
    ):
        table.add_row(key, str(value))
    for reason, n in sorted(s["rejected"].items()):
        table.add_row(f"  rejected: {reason}", str(n))
    if s["tokens"]:
        table.add_row("tokens", f"{s['tokens']} ({s['tokens_left_over']} left over after packing)")
    out.print(table)
    if s["note"]:
        out.print(s["note"])


@app.command()
def inspect(
    dataset: Annotated[str, typer.Argument(help="Dataset URL or path.")],
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every shard; fail naming each bad one.")] = False,
    samples: Annotated[int, typer.Option(help="Sample rows to show.")] = 3,
    config: Annotated[Path | None, typer.Option(help="Job config YAML; its storage section is used.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show a dataset's schema, counts and sample rows; --verify checks every shard."""

    def go():
        from petatrain.data.inspect import describe

        options = config_mod.load(config, list(set_ or [])).storage.options()
        report = describe(dataset, options=options, verify=verify, samples=samples)
        if as_json:
            _print_json(report)
        else:
            _render_inspect(report)
        if verify and report["problems"]:
            for line in report["problems"]:
                console.print(f"[red]{line}[/red]", highlight=False, soft_wrap=True)
            _fail(f"{len(report['problems'])} of {report['shards']} shards missing or corrupt", 1)

    _guarded(go)


def _render_inspect(r: dict[str, Any]) -> None:
    table = Table(title=f"dataset {r['dataset']}", show_header=False)
    for key in (
        "kind",
        "rows",
        "documents",
        "shards",
        "bytes",
        "rows_in",
        "exact_duplicates",
        "near_duplicates",
        "tokens",
        "sources",
        "updated",
    ):
        if r.get(key) not in (None, 0, ""):
            table.add_row(key, str(r[key]))
    for reason, n in sorted(r["rejected"].items()):
        table.add_row(f"rejected: {reason}", str(n))
    table.add_row("schema", ", ".join(f"{c['name']}: {c['type']}" for c in r["schema"]))
    if r.get("tokenizer"):
        t = r["tokenizer"]
        table.add_row("tokenizer", f"{t['spec']} (vocab {t['vocab_size']}, {t['dtype']}, eos {t['eos_id']})")
    if r["verified"] is not None:
        table.add_row("verify", "all shards match their checksums" if r["verified"] else "FAILED")
    out.print(table)
    for i, row in enumerate(r["samples"]):
        out.print(f"[bold]sample {i}[/bold] " + json.dumps(row, ensure_ascii=False)[:400], highlight=False)


@app.command()
def demo(
    root: Annotated[str, typer.Option(help="Where the demo corpus, dataset and run go.")] = DEMO_ROOT,
    documents: Annotated[int, typer.Option(help="Unique documents to generate.")] = 3000,
    train_: Annotated[bool, typer.Option("--train/--no-train", help="End with the training demo.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Generate a corpus with duplicates and bad records, ingest it, stream it with 2 ranks
    resuming half-way with 3, then train a small GPT on 2 workers through a worker kill."""

    def go():
        from petatrain.data import synth
        from petatrain.data.elastic_demo import elastic_resume
        from petatrain.data.ingest import IngestJob, run
        from petatrain.data.inspect import describe

        _claim_stdout(as_json)
        corpus_dir = os.path.join(root, "demo-corpus")
        dataset = os.path.join(root, "datasets", "demo")
        if not os.path.isdir(corpus_dir):
            console.print(f"generating a synthetic corpus in {corpus_dir}")
            synth.generate(corpus_dir, documents=documents, files=4)
        # Byte tokens packed into rows of 65 (64 inputs + 1 target), in shards small enough
        # that the last one can be held out for evaluation.
        ingest_cfg = config_mod.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="1MB")
        summary = run(IngestJob(sources=[corpus_dir], out=dataset, config=ingest_cfg))
        report = describe(dataset, verify=True, samples=1)
        stream = elastic_resume(dataset)
        result = {"ingest": summary.to_dict(), "inspect": report, "stream": stream}
        if not as_json:
            _render_ingest(summary.to_dict())
            _render_inspect(report)
            _render_stream(stream)
        if not stream["exactly_once"]:
            _fail("the loader did not deliver every sample exactly once", 1)
        if train_:
            result["train"] = _demo_train(root, dataset, as_json)
        if as_json:
            _print_json(result)
            return
        out.print(f"\nNext: [bold].venv/bin/petatrain report {result.get('train', {}).get('run', '')}[/bold]")

    _guarded(go)


def _demo_train(root: str, dataset: str, as_json: bool) -> dict[str, Any]:
    from petatrain.chaos.inject import parse
    from petatrain.observe.report import write_report
    from petatrain.storage.fs import remove_tree
    from petatrain.train.launch import TrainJob, run
    from petatrain.train.sample import sample_text

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
    cfg = config_mod.load(example if example.exists() else None, [f"data.dataset={dataset}"])
    run_dir = os.path.join(root, "runs", "demo")
    remove_tree(run_dir)  # a fresh run each time: resuming a finished run would train nothing
    if not as_json:
        out.print(f"\n[bold]training[/bold] a {cfg.model.n_layer}-layer GPT on 2 workers; rank 1 is killed at step 17")
    summary = run(TrainJob(config=cfg, run_url=run_dir, injections=[parse("kill@step=17,rank=1")]))
    report = write_report(summary["run"])
    samples = sample_text(cfg, summary["final"], prompts=["the ", "data "], new_tokens=60)
    if not as_json:
        for f in summary["failures"]:
            out.print(f"recovered from {f['cause']} (rank {f['rank']})", highlight=False)
        _render_report(report)
        for text in samples:
            out.print(f"[bold]sample[/bold] {text!r}", highlight=False)
    return {**summary, "goodput": report["goodput"], "samples": samples}


def _render_stream(s: dict[str, Any]) -> None:
    table = Table(title="stream one epoch, stop half-way, resume with another world size", show_header=False)
    table.add_row("samples in the epoch", str(s["samples_in_epoch"]))
    table.add_row(f"consumed by {s['ranks_before']} ranks", str(s["consumed_before"]))
    table.add_row(f"resumed by {s['ranks_after']} ranks", str(s["consumed_after"]))
    table.add_row("saved loader state", json.dumps(s["state"]))
    table.add_row("duplicates / missing", f"{s['duplicates']} / {s['missing']}")
    verdict = "[green]every sample exactly once[/green]" if s["exactly_once"] else "[red]NOT exactly once[/red]"
    table.add_row("result", verdict)
    out.print(table)


@app.command("config")
def show_config(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (default: built-in defaults).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
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
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    run_dir: RunDir = None,
    address: Annotated[str, typer.Option(help="Ray cluster address (default: start a local Ray).")] = "",
    inject: Injects = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Train on Ray Train (DDP or FSDP), checkpointing asynchronously and recovering from faults."""
    _guarded(lambda: _train(config, list(set_ or []), run_dir, address, list(inject or []), as_json))


@app.command()
def chaos(
    config: Annotated[Path, typer.Argument(help="Job config YAML.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    run_dir: RunDir = None,
    address: Annotated[str, typer.Option(help="Ray cluster address (default: start a local Ray).")] = "",
    inject: Injects = None,
    every: Annotated[str, typer.Option("--every", help="Soak: a random fault this often, e.g. 120s.")] = "",
    duration: Annotated[str, typer.Option("--for", help="Soak: for this long, e.g. 20m.")] = "",
    seed: Annotated[int, typer.Option(help="Soak: seed of the random fault kinds and ranks.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Train with injected faults (--inject ... or a random soak), then print the goodput report."""

    def go():
        specs = list(inject or [])
        if every or duration:
            from petatrain.chaos.soak import parse_duration, soak_injections

            cfg = config_mod.load(config, list(set_ or []))
            specs += soak_injections(every, duration, seed=seed, workers=cfg.parallel.worker_range()[0])
        stop_after = parse_duration(duration, "--for") if duration else None
        _train(config, list(set_ or []), run_dir, address, specs, as_json, stop_after_s=stop_after)

    _guarded(go)


# --- petatrain report (observe) -------------------------------------------------------


@app.command()
def report(
    run: Annotated[str, typer.Argument(help="Run directory URL or path (holds events.jsonl).")],
    config: Annotated[Path | None, typer.Option(help="Job config YAML; its storage section is used.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (report.json).")] = False,
) -> None:
    """Goodput of a run: where its wall time went, its faults, loss curve and timeline (PNG + HTML)."""

    def go():
        from petatrain.observe.report import write_report

        options = config_mod.load(config, list(set_ or [])).storage.options()
        written = write_report(run, options)
        if as_json:
            _print_json(written)
        else:
            _render_report(written)

    _guarded(go)


# --- plan and profile (issue 5) -------------------------------------------------------


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
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Estimate memory, FLOPs, step time, goodput, time and cost on every accelerator, count and
    strategy; recommend one and say why each other candidate lost."""

    def go():
        from petatrain.plan.recommend import PlanRequest, plan

        if count < 0 or max_count < 1 or budget < 0 or deadline < 0 or mtbf_hours < 0:
            _fail("--count, --budget, --deadline and --mtbf-hours must be >= 0 and --max-count >= 1")
        cfg = config_mod.load(config, list(set_ or []))
        request = PlanRequest(
            accelerator=accelerator,
            count=count,
            max_count=max_count,
            budget_usd=budget,
            deadline_hours=deadline,
            mtbf_hours=mtbf_hours,
        )
        result = plan(cfg, request).to_dict()
        if as_json:
            _print_json(result)
        else:
            _render_plan(result, show)
        if result["recommended"] is None:
            _fail(f"no candidate is {result['objective']}; see the reasons above (or --json)", 1)

    _guarded(go)


def _train(config, overrides, run_dir, address, specs, as_json, stop_after_s: float | None = None) -> None:
    import time as _time

    from petatrain.chaos.inject import parse
    from petatrain.train.launch import TrainJob, run

    cfg = config_mod.load(config, overrides)
    injections = [parse(s) for s in specs]
    run_url = run_dir or os.path.join(".petatrain", "runs", _time.strftime("%Y%m%d-%H%M%S"))

    def progress(event: dict[str, Any]) -> None:
        if as_json:
            return
        kind = event["event"]
        if kind == "step" and (event["step"] % 10 == 0 or event["step"] == cfg.train.steps):
            console.print(
                f"step {event['step']:>6}  loss {event['loss'] if event['loss'] is None else round(event['loss'], 4)}"
            )
        elif kind in ("failure", "restart", "attempt_start"):
            detail = {k: v for k, v in event.items() if k not in ("t", "event")}
            console.print(f"[yellow]{kind}[/yellow] {json.dumps(detail)[:200]}")

    job = TrainJob(
        config=cfg,
        run_url=run_url,
        options=cfg.storage.options(),
        address=address,
        injections=injections,
        on_event=progress,
        stop_after_s=stop_after_s,
    )
    _claim_stdout(as_json)
    summary = run(job)
    from petatrain.observe.report import write_report

    report = write_report(summary["run"], cfg.storage.options())
    if as_json:
        _print_json({**summary, "report": report})
        return
    out.print(f"trained {summary['steps']} steps in {summary['wall_s']:.1f}s, {summary['attempts']} attempt(s)")
    for f in summary["failures"]:
        out.print(f"  recovered from {f['cause']} (rank {f['rank']}): {f['detail'][:120]}")
    _render_report(report)
    out.print(f"final weights: {summary['final']}")


def _render_report(r: dict[str, Any]) -> None:
    steps = r["steps"]
    target = steps["target"] if steps["target"] is not None else "?"
    out.print(
        f"[bold]goodput {100 * r['goodput']:.1f}%[/bold]  run {r.get('run_id') or r['run']}  status {r['status']}\n"
        f"wall {r['wall_s']:.1f} s  steps {steps['kept']}/{target} kept, {steps['recomputed']} recomputed  "
        f"attempts {r['attempts']}",
        highlight=False,
    )
    wall = r["wall_s"] or 0.0
    split = Table(title="where the wall time went")
    split.add_column("part")
    split.add_column("seconds", justify="right")
    split.add_column("share", justify="right")
    for name, seconds in r["time"].items():
        share = f"{100 * seconds / wall:.1f}%" if wall > 0 else "–"
        split.add_row(name.removesuffix("_s").replace("_", " "), f"{seconds:.2f}", share)
    out.print(split)
    if r["note"]:
        out.print(f"[yellow]{r['note']}[/yellow]", highlight=False)
    if r["faults"]:
        faults = Table(title="faults")
        for column in ("cause", "rank", "attempt", "step", "detected (s)", "recovered (s)", "steps lost"):
            faults.add_column(column, justify="left" if column == "cause" else "right")
        for f in r["faults"]:
            faults.add_row(
                f["cause"],
                _or_dash(f["rank"]),
                str(f["attempt"]),
                _or_dash(f["step"]),
                _or_dash(f["detected_after_s"], "{:.2f}"),
                _or_dash(f["recovered_after_s"], "{:.2f}"),
                _or_dash(f["steps_lost"]),
            )
        out.print(faults)
    else:
        out.print("no faults")
    files = r["files"]
    out.print(f"report: {files['html']}\nplots:  {files['loss_png']}, {files['timeline_png']}", highlight=False)


def _or_dash(value: Any, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value)


# --- end petatrain report -------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "never"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} d"
    if seconds >= 7200:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds:,.0f} s"


def _render_plan(r: dict[str, Any], show: int) -> None:
    m = r["model"]
    out.print(
        f"[bold]model[/bold] {m['params'] / 1e9:,.3f} B parameters "
        f"({m['params_non_embedding'] / 1e9:,.3f} B non-embedding), {m['tokens'] / 1e9:,.2f} B tokens, "
        f"{m['model_flops_per_token'] / 1e9:,.2f} GFLOP per token",
        highlight=False,
    )
    cands = r["candidates"]
    rec = r["recommended"]
    runnable = sorted(
        (c for c in cands if c["fits"] and not c["reason"].startswith("infeasible")),
        key=lambda c: (bool(c["reason"]), c["cost_usd"]),
    )
    table = Table(
        title=f"candidates ({len(cands)} estimated; showing {min(show, len(runnable))} runnable, cheapest first)"
    )
    for col in (
        "accelerator",
        "n",
        "strategy",
        "GiB/dev",
        "step",
        "MFU",
        "goodput",
        "time",
        "$ on-demand",
        "$ spot",
        "verdict",
    ):
        table.add_column(col, justify="left" if col in ("accelerator", "strategy", "verdict") else "right")
    for c in runnable[:show]:
        verdict = "[green]recommended[/green]" if rec and _same(c, rec) else (c["reason"].split(":")[0] or "ok")
        table.add_row(
            c["accelerator"],
            str(c["count"]),
            c["strategy"],
            _gib(c["memory_bytes"]["total"]),
            f"{c['step_time_s']:.3g} s",
            f"{c['mfu']:.1%}",
            f"{c['goodput']:.1%}",
            _duration(c["run_time_s"]),
            f"{c['cost_usd']:,.0f}",
            f"{c['cost_usd_spot']:,.0f}",
            verdict,
        )
    out.print(table)
    reasons: dict[str, int] = {}
    for c in cands:
        if c["reason"]:
            key = c["reason"].split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        out.print("rejected: " + ", ".join(f"{n} {k}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
    if rec:
        mem = rec["memory_bytes"]
        out.print(
            f"[bold green]recommended[/bold green] ({r['objective']}): {rec['count']} x {rec['accelerator']} with "
            f"{rec['strategy']}: {_duration(rec['run_time_s'])}, ${rec['cost_usd']:,.0f} on demand "
            f"(${rec['cost_usd_spot']:,.0f} on spot); {_gib(mem['total'])} GiB per device "
            f"(weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, optimizer {_gib(mem['optimizer'])}, "
            f"activations {_gib(mem['activations'])}, other {_gib(mem['other'])}); step {rec['step_time_s']:.3g} s at "
            f"{rec['mfu']:.1%} MFU; checkpoint every {_duration(rec['checkpoint']['interval_s'])}",
            highlight=False,
        )


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("accelerator", "count", "strategy"))


@app.command("profile")
def profile_cmd(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (model and train sections).")] = None,
    steps: Annotated[int, typer.Option(help="Measured training steps (after one warm-up step).")] = 5,
    dataset: Annotated[
        bool, typer.Option("--dataset", help="Read batches from data.dataset instead of random tokens.")
    ] = False,
    save: Annotated[bool, typer.Option(help="Save the calibration that later plan runs use.")] = True,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override a.b=c (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run real training steps on this machine, measure memory, time split and FLOP/s, compare
    each figure with the plan's estimate, and save a calibration for plan."""

    def go():
        from petatrain.plan.profile import profile

        if steps < 1:
            _fail("--steps must be >= 1")
        cfg = config_mod.load(config, list(set_ or []))
        report = profile(cfg, steps=steps, use_dataset=dataset, save=save)
        if as_json:
            _print_json(report)
        else:
            _render_profile(report)

    _guarded(go)


def _render_profile(r: dict[str, Any]) -> None:
    table = Table(title=f"profile on {r['device']} ({r['steps']} steps, {r['tokens_per_step']:,} tokens each)")
    for col in ("figure", "measured", "plan estimate", "error"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for row in r["comparison"]:
        err = row["error"]
        table.add_row(row["figure"], row["measured_text"], row["estimate_text"], "" if err is None else f"{err:+.1%}")
    out.print(table)
    t = r["measured"]["time_split_s"]
    out.print(
        "step split: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
        + f"; verdict: [bold]{r['verdict']}[/bold]",
        highlight=False,
    )
    out.print(f"peak memory measured with {r['memory_method']}", highlight=False)
    if r.get("calibration_path"):
        out.print(f"calibration saved to {r['calibration_path']} (plan uses it for {r['calibration']['accelerator']})")


if __name__ == "__main__":  # pragma: no cover
    app()
