"""`petatrain` command line: parse, call the API, render (rich tables or --json)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
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
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _unwrap(exc: BaseException) -> BaseException:
    """The user-facing cause of an error raised inside a Ray task, if there is one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PetatrainError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


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
        cause = _unwrap(exc)
        if cause is not None:
            _fail(str(cause))
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _fail(f"{type(exc).__name__}: {first} (set PETATRAIN_DEBUG=1 for the traceback)", 1)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


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
    root: Annotated[str, typer.Option(help="Where the demo corpus and dataset go.")] = DEMO_ROOT,
    documents: Annotated[int, typer.Option(help="Unique documents to generate.")] = 3000,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Generate a corpus with duplicates and bad records, ingest it, inspect it, and stream it
    with 2 ranks, resuming half-way with 3."""

    def go():
        from petatrain.data import synth
        from petatrain.data.elastic_demo import elastic_resume
        from petatrain.data.ingest import IngestJob, run
        from petatrain.data.inspect import describe

        corpus_dir = os.path.join(root, "demo-corpus")
        dataset = os.path.join(root, "datasets", "demo")
        if not os.path.isdir(corpus_dir):
            console.print(f"generating a synthetic corpus in {corpus_dir}")
            synth.generate(corpus_dir, documents=documents, files=4)
        summary = run(IngestJob(sources=[corpus_dir], out=dataset, config=config_mod.IngestConfig()))
        report = describe(dataset, verify=True, samples=2)
        stream = elastic_resume(dataset)
        if as_json:
            _print_json({"ingest": summary.to_dict(), "inspect": report, "stream": stream})
            return
        _render_ingest(summary.to_dict())
        _render_inspect(report)
        _render_stream(stream)
        out.print(f"\nNext: [bold].venv/bin/petatrain inspect {dataset} --verify[/bold]")
        if not stream["exactly_once"]:
            _fail("the loader did not deliver every sample exactly once", 1)

    _guarded(go)


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
