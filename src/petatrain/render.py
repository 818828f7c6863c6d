"""Rich tables for each verb's result: what `petatrain VERB` prints without --json."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from petatrain.console import RAY_SESSION_LOGS

if TYPE_CHECKING:
    from petatrain.api import TrainResult

out = Console()
out.soft_wrap = not out.is_terminal  # a pipe or a CI log: lines as long as they are, no path wrapped


def show_table(table: Table) -> None:
    """A table whole, at any width: as wide as its values on a pipe or a CI log (which rich would cut at
    80 columns), and on a terminal too narrow for it one block per row, `column: value` a line, so
    that no value is cut and no path is wrapped."""
    from rich.measure import Measurement

    needed = Measurement.get(out, out.options.update(max_width=100_000), table).maximum
    if needed <= out.width:
        out.print(table)
    elif not out.is_terminal:  # rich clamps a print's width to the console's: widen it for this table
        width = out.width
        out.width = needed
        try:
            out.print(table)
        finally:
            out.width = width
    else:
        _vertical(table)


def _vertical(table: Table) -> None:
    """Each row as a block: its first cell, then `column: value` a line (a two-column table without
    headers, key and value, as `key: value`)."""
    if table.title:
        out.print(table.title, style="bold", highlight=False, soft_wrap=True)
    headers = [str(column.header) for column in table.columns]
    cells = [list(column.cells) for column in table.columns]

    def cell(i: int, row: int) -> Any:
        return cells[i][row] if row < len(cells[i]) else ""

    for row in range(table.row_count):
        if not table.show_header:
            out.print(cell(0, row), ": ", *(cell(i, row) for i in range(1, len(cells))), sep="", soft_wrap=True)
            continue
        out.print(cell(0, row), style="bold", highlight=False, soft_wrap=True)
        for i in range(1, len(cells)):
            out.print(f"  {headers[i]}: ", cell(i, row), sep="", highlight=False, soft_wrap=True)


def ingest(s: dict[str, Any]) -> None:
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
        ("files split", f"{s.get('files_split', 0)} (read as {s.get('pieces', 0)} pieces in all)"),
        ("seconds", f"{s['seconds']:.1f} ({rate:.1f} MB/s of input)"),
    ):
        table.add_row(key, str(value))
    for key in ("files_removed", "files_changed"):  # --register --refresh
        if s.get(key):
            table.add_row(key.replace("_", " "), str(s[key]))
    for reason, n in sorted(s["rejected"].items()):
        table.add_row(f"  rejected: {reason}", str(n))
    if s["tokens"]:
        table.add_row("tokens", f"{s['tokens']} ({s['tokens_left_over']} left over after packing)")
    show_table(table)
    if s["note"]:
        out.print(s["note"])


def inspect(r: dict[str, Any]) -> None:
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
    if r.get("source_fields"):
        table.add_row("source fields", ", ".join(r["source_fields"]))
    if r.get("partitions"):
        table.add_row("hive partitions", ", ".join(r["partitions"]) + " (from the files' folder names)")
    if r.get("tokenizer"):
        t = r["tokenizer"]
        table.add_row("tokenizer", f"{t['spec']} (vocab {t['vocab_size']}, {t['dtype']}, eos {t['eos_id']})")
    if r.get("encryption"):
        e = r["encryption"]
        keys = ", ".join(f"{k}: {v['shards']} shards, master key v{v['key_version']}" for k, v in e["keys"].items())
        plain = f"; {e['plaintext_shards']} plaintext shards" if e["plaintext_shards"] else ""
        table.add_row("encrypted", f"{e['algorithm']} ({keys}{plain})")
    if r.get("signature"):
        s = r["signature"]
        table.add_row("signed", f"{s['key_id']} ({'verified' if s['verified'] else 'not verified: no key configured'})")
    if r["verified"] is not None:
        table.add_row("verify", "all shards match their checksums" if r["verified"] else "FAILED")
    show_table(table)
    if len(r.get("versions") or []) > 1:
        versions = Table(title="versions (DATASET@vN opens one)")
        for column in ("version", "committed", "rows", "tokens", "+rows", "+source files", "duplicates dropped"):
            versions.add_column(column, justify="left" if column == "committed" else "right", overflow="fold")
        for v in r["versions"]:
            versions.add_row(
                f"v{v['version']}", v["committed"], f"{v['rows']:,}", f"{v['tokens']:,}", f"{v['rows_added']:,}",
                f"{v['sources_added']:,}", f"{v['duplicates_dropped']:,}",
            )  # fmt: skip
        show_table(versions)
    for i, row in enumerate(r["samples"]):
        out.print(f"[bold]sample {i}[/bold] " + json.dumps(row, ensure_ascii=False)[:400], highlight=False)


def stream(s: dict[str, Any]) -> None:
    table = Table(title="stream one epoch, stop half-way, resume with another world size", show_header=False)
    table.add_row("samples in the epoch", str(s["samples_in_epoch"]))
    table.add_row(f"consumed by {s['ranks_before']} ranks", str(s["consumed_before"]))
    table.add_row(f"resumed by {s['ranks_after']} ranks", str(s["consumed_after"]))
    table.add_row("saved loader state", json.dumps(s["state"]))
    table.add_row("duplicates / missing", f"{s['duplicates']} / {s['missing']}")
    verdict = "[green]every sample exactly once[/green]" if s["exactly_once"] else "[red]NOT exactly once[/red]"
    table.add_row("result", verdict)
    show_table(table)


def report(r: dict[str, Any]) -> None:
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
    show_table(split)
    from petatrain.observe.goodput import DEFINITIONS

    for name in r["time"]:  # what each part is, one line each
        out.print(f"  {name.removesuffix('_s').replace('_', ' ')}: {DEFINITIONS.get(name, '')}", highlight=False)
    out.print("  (attempts are numbered from 1: attempt 1 is the first)", highlight=False)
    if r.get("trained_on"):
        out.print(f"trained on: {_reads(r['trained_on'])}", highlight=False, soft_wrap=True)
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
                str(f["attempt"] + 1),
                _or_dash(f["step"]),
                _or_dash(f["detected_after_s"], "{:.2f}"),
                _or_dash(f["recovered_after_s"], "{:.2f}"),
                _or_dash(f["steps_lost"]),
            )
        show_table(faults)
    else:
        out.print("no faults")
    if r.get("pipeline"):
        _pipeline(r["pipeline"])
    if r.get("communication"):
        _communication(r["communication"])
    files = r["files"]
    out.print(f"report: {files['html']}\nplots:  {files['loss_png']}, {files['timeline_png']}", highlight=False)


def _pipeline(p: dict[str, Any]) -> None:
    """The stage table: each pipeline rank's compute, idle share and the partition's prediction."""
    table = Table(title=_pipeline_title(p))
    columns = ("rank", "units", "steps", "idle", "compute s (predicted)", "grad reduce s", "memory MiB (predicted)")
    for column in columns:
        table.add_column(column, justify="left" if column == "units" else "right")
    for s in p["stages_measured"]:
        memory = _mib(s.get("memory_bytes"))
        table.add_row(
            str(s["rank"]),
            ", ".join(s["units"] or []),
            str(s["steps"]),
            _or_dash(s["idle_share"], "{:.1%}"),
            f"{s['busy_s']:.2f}{_predicted(s['predicted_busy_s'], s['prediction_error'], '{:.2f}')}",
            _or_dash(s.get("reduce_s"), "{:.2f}"),
            "–"
            if memory is None
            else f"{memory:.1f}" + _predicted(_mib(s.get("predicted_memory_bytes")), s.get("memory_error"), "{:.1f}"),
        )
    show_table(table)


def _communication(traced: list[dict[str, Any]]) -> None:
    """The mesh table of the traced steps: per rank, each dimension's ms a step (collectives, MiB)."""
    from petatrain.observe.report import step_span

    dimensions = sorted({name for t in traced for name in t["dimensions"]})
    table = Table(title="communication by mesh dimension, traced steps: ms a step (collectives, MiB)")
    for column in ("attempt", "rank", "steps", "step ms", *dimensions):
        table.add_column(column, justify="right")
    for t in traced:
        cells = []
        for name in dimensions:
            d = t["dimensions"].get(name)
            mib = "" if d is None or d["mib"] is None else f", {d['mib']:.2f}"
            cells.append("–" if d is None else f"{_or_dash(d['ms'], '{:.1f}')} ({d['calls']:g}{mib})")
        steps = step_span(t["first_step"], t["steps"])
        table.add_row(str(t["attempt"] + 1), str(t["rank"]), steps, f"{t['step_ms']:.1f}", *cells)
    show_table(table)


def _predicted(value: float | None, error: float | None, fmt: str) -> str:
    """ " (PREDICTED, ERROR)" after a measured figure, or nothing without a prediction."""
    if value is None:
        return ""
    return f" ({fmt.format(value)}, {error:+.0%})" if error is not None else f" ({fmt.format(value)})"


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def _pipeline_title(p: dict[str, Any]) -> str:
    measured, theory = p.get("bubble_measured"), p.get("bubble_theory")
    bubble = f"bubble {measured:.1%} measured" if measured is not None else "bubble not measured"
    return (
        f"pipeline {p.get('schedule')}: {p.get('stages')} stages x {p.get('chunks')} chunks, {p.get('microbatches')} "
        f"micro-batches; {bubble}, {theory or 0:.1%} in theory"
    )


def _reads(reads: list[dict[str, Any]]) -> str:
    """What a run read: "ds@v2: 1,541 new rows, 513 replayed of v1"."""
    parts = []
    for r in reads:
        name = f"{r['dataset']}@v{r['version']}" if r["version"] is not None else r["dataset"]
        how = {"new": "new rows once", "replay": "rows replayed", "epochs": "rows"}.get(r["kind"], r["kind"])
        parts.append(f"{name}: {r['rows']:,} {how}")
    return "; ".join(parts) or "–"


def dataset_gc(done: dict[str, Any]) -> None:
    removed = ", ".join(f"v{v}" for v in done["removed"]) or "nothing"
    out.print(f"{done['dataset']}: removed {removed}; kept {len(done['kept'])} version(s)", highlight=False)
    for version, who in done["in_use"].items():
        shown = ", ".join(who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
        out.print(f"  v{version} kept: {shown} names it", highlight=False, soft_wrap=True)


def dataset_events(done: dict[str, Any]) -> None:
    """`petatrain dataset events`: a line per version, what it added."""
    events = done["events"]
    if not events:
        out.print(f"{done['dataset']}: no version after v{done['after']}", highlight=False, soft_wrap=True)
        return
    for e in events:
        if e.get("removed"):
            out.print(f"v{e['version']}  (its record was removed by gc before its event was written)", highlight=False)
            continue
        added = "?" if e["rows_added"] is None else f"{e['rows_added']:+,}"
        line = f"v{e['version']}  {e['committed']}  rows {e['rows']:,} ({added})"
        if e["tokens"]:
            line += f", tokens {e['tokens']:,}"
        if e.get("duplicates_dropped"):
            line += f", {e['duplicates_dropped']:,} duplicates dropped"
        if e.get("rejected"):
            line += f", {e['rejected']:,} rejected"
        out.print(line + f"  sha256 {e['manifest_sha256'][:12]}", highlight=False, soft_wrap=True)


def mlflow_synced(done: dict[str, Any]) -> None:
    out.print(
        f"MLflow run {done['mlflow_run_id']} ({done['experiment']}): {done['params']} params, "
        f"{done['metrics']} metric points logged",
        highlight=False,
    )
    for v in done["versions"]:
        out.print(f"  {v['model']} -> MLflow model version {v['mlflow_version']}", highlight=False)


def evaluation(result: dict[str, Any]) -> None:
    """`petatrain evaluate`: both models' held-out losses per split, and the verdict."""
    table = Table(title=f"held-out rows of {result['dataset']} ({result['eval_fraction']:g} of each shard)")
    table.add_column("split")
    table.add_column("rows", justify="right")
    table.add_column(f"candidate {result['candidate']['ref']}", justify="right")
    if result["against"]:
        table.add_column(f"against {result['against']['ref']}", justify="right")
    losses = result["losses"]
    for split in ("all", "newest", "earlier"):
        row = [split, str(losses["candidate"][split]["rows"]), _or_dash(losses["candidate"][split]["loss"], "{:.4f}")]
        if result["against"]:
            row.append(_or_dash(losses["against"][split]["loss"], "{:.4f}"))
        table.add_row(*row)
    show_table(table)
    verdict = result["verdict"]
    mark = "[green]passes[/green]" if verdict["passed"] else "[red]does not pass[/red]"
    out.print(f"gate: {mark}: {verdict['reason']}", highlight=False, soft_wrap=True)


def promoted(record: dict[str, Any]) -> None:
    forced = " (forced past the gate)" if record.get("forced") else ""
    out.print(
        f"registry://{record['name']}@{record['version']} is the champion{forced}: {record['run']} "
        f"({record['checkpoint']}, step {record['step']}, {record['checksum']})",
        highlight=False,
        soft_wrap=True,
    )
    if record.get("eval") and record["eval"].get("verdict"):
        out.print(f"gate: {record['eval']['verdict']['reason']}", highlight=False, soft_wrap=True)


def loop_cycle(cycle: Any) -> None:
    """`petatrain loop`: what a cycle did, one line (and the times of a cycle that trained)."""
    import time

    stamp = time.strftime("%H:%M:%S")
    record = cycle.record
    if cycle.outcome == "idle":
        out.print(f"{stamp} no data yet", highlight=False)
        return
    if cycle.outcome == "done":
        handled = f" ({record['outcome']})" if record.get("outcome") else ""
        out.print(f"{stamp} up to date: v{cycle.version} was handled{handled}", highlight=False)
        return
    if cycle.outcome == "committed":
        out.print(f"{stamp} v{cycle.version} committed: {record.get('rows_added', '?')} rows added", highlight=False)
        return
    if cycle.outcome == "trained":
        out.print(f"{stamp} v{cycle.version}: {record['run']} trained to step {record['steps']}", highlight=False)
        return
    if cycle.outcome == "promoted":
        line = f"{stamp} v{cycle.version}: {record['run']} promoted as version {record['model_version']}"
    else:
        line = f"{stamp} v{cycle.version}: {record['run']} not promoted ({record['reason']}); the champion serves on"
    times = ", ".join(f"{k} {v:.1f}s" for k, v in record.get("times", {}).items())
    staleness = record.get("staleness_s")
    after = f"; {staleness:.1f}s from the commit" if staleness is not None else ""
    out.print(f"{line} ({times}{after})", highlight=False, soft_wrap=True)


def rolled_back(alias: dict[str, Any]) -> None:
    out.print(f"registry://{alias['name']}@{alias['alias']} is version {alias['version']} again", highlight=False)


def lineage(result: dict[str, Any]) -> None:
    """A run's chain, newest first, as `petatrain lineage` prints it: a block per run, so that no
    path or count is cut in a narrow terminal or a CI log."""
    out.print(f"[bold]lineage of {escape(result['run'])}[/bold] (newest first)", soft_wrap=True)
    for i, link in enumerate(result["chain"], 1):
        if link.get("missing"):
            out.print(f"{i}. {link['run']}  (gone: its ledger is no longer there)", highlight=False, soft_wrap=True)
            continue
        how = link["how"] if link["replay"] is None else f"continue (replay {link['replay']:g})"
        loss = _or_dash(link["eval_loss"], "{:.4f}")
        steps = f"steps {link['start_step']}->{link['step']}"
        out.print(
            f"{i}. {link['run']}  {how}  {steps}  {link['status']}  eval loss {loss}", highlight=False, soft_wrap=True
        )
        out.print(f"   trained on: {_reads(link['reads'])}", highlight=False, soft_wrap=True)
        if link.get("promotions"):
            out.print(f"   promoted as: {', '.join(link['promotions'])}", highlight=False, soft_wrap=True)


def _or_dash(value: Any, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value)


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


def plan(r: dict[str, Any], show: int) -> None:
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
        "goodput spot",
        "time spot",
        "$ spot",
        "verdict",
    ):
        table.add_column(col, justify="left" if col in ("accelerator", "strategy", "verdict") else "right")
    for c in runnable[:show]:
        verdict = "[green]recommended[/green]" if rec and _same(c, rec) else (c["reason"].split(":")[0] or "ok")
        shape = c.get("layout") or {}
        table.add_row(
            c["accelerator"],
            str(c["count"]),
            _label(c),
            _gib(c["memory_bytes"]["total"]),
            f"{c['step_time_s']:.3g} s",
            f"{c['mfu']:.1%}",
            f"{c['goodput']:.1%}",
            _duration(c["run_time_s"]),
            f"{c['cost_usd']:,.0f}",
            f"{c['goodput_spot']:.1%}",
            _duration(c["run_time_spot_s"]),
            f"{c['cost_usd_spot']:,.0f}",
            verdict,
        )
    show_table(table)
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
            f"{_label(rec)}: {_duration(rec['run_time_s'])}, ${rec['cost_usd']:,.0f} on demand "
            f"(${rec['cost_usd_spot']:,.0f} on spot); {_gib(mem['total'])} GiB per device "
            f"(weights {_gib(mem['weights'])}, gradients {_gib(mem['gradients'])}, optimizer {_gib(mem['optimizer'])}, "
            f"activations {_gib(mem['activations'])}, other {_gib(mem['other'])}); step {rec['step_time_s']:.3g} s at "
            f"{rec['mfu']:.1%} MFU; checkpoint every {_duration(rec['checkpoint']['interval_s'])}",
            highlight=False,
        )

    versus = r.get("pipeline_vs_fsdp") or {}
    if rec and f"{rec['accelerator']} x{rec['count']}" in versus:
        out.print(
            f"pipeline or fsdp on {rec['count']} x {rec['accelerator']}: "
            + versus[f"{rec['accelerator']} x{rec['count']}"],
            highlight=False,
        )
    choices = r.get("layouts") or {}
    if rec and f"{rec['accelerator']} x{rec['count']}" in choices:
        out.print(f"layouts on {rec['count']} x {rec['accelerator']}:", highlight=False)
        for line in choices[f"{rec['accelerator']} x{rec['count']}"]:
            out.print(f"  {line}", highlight=False)
    if rec and rec.get("layout"):
        shape = rec["layout"]
        out.print(f"{shape['label']}: " + " ".join(f"--set {s}" for s in shape["settings"]), highlight=False)
    calibrations = (r.get("assumptions") or {}).get("calibrations") or {}
    for name, source in calibrations.items():  # a calibrated efficiency says where it comes from
        out.print(f"{name}'s efficiency is calibrated by {source}", highlight=False)
    if not calibrations:
        out.print("efficiencies are the catalog's defaults (petatrain profile calibrates them)", highlight=False)


def _label(candidate: dict[str, Any]) -> str:
    """A searched layout's name (`pipeline 16x4 M=128`, `tensor 8x8 fsdp b=4`), else the strategy's."""
    return str((candidate.get("layout") or {}).get("label") or candidate["strategy"])


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("accelerator", "count", "strategy"))


def profile(r: dict[str, Any]) -> None:
    table = Table(title=f"profile on {r['device']} ({r['steps']} steps, {r['tokens_per_step']:,} tokens each)")
    for col in ("figure", "measured", "plan estimate", "error"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for row in r["comparison"]:
        err = row["error"]
        table.add_row(row["figure"], row["measured_text"], row["estimate_text"], "" if err is None else f"{err:+.1%}")
    show_table(table)
    t = r["measured"]["time_split_s"]
    out.print(
        "step split: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
        + f"; verdict: [bold]{r['verdict']}[/bold]",
        highlight=False,
    )
    out.print(f"peak memory measured with {r['memory_method']}", highlight=False)
    spread = r["measured"].get("step_time_spread")
    if spread is not None:
        out.print(f"the {r['steps']} timed steps spread {spread:.0%} (interquartile range / median)", highlight=False)
    out.print(f"the estimate's efficiency is from {r['estimate'].get('calibration_source', '?')}", highlight=False)
    if r.get("tensor_collectives", {}).get("skipped"):
        out.print(f"[yellow]tensor-parallel collectives not measured: {r['tensor_collectives']['skipped']}[/yellow]")
    elif r.get("tensor_collectives"):
        _tensor_collectives(r["tensor_collectives"])
    if r.get("calibration_refused"):
        out.print(f"[yellow]calibration {escape(r['calibration_refused'])}[/yellow]", highlight=False)
    if r.get("calibration_path"):
        out.print(f"calibration saved to {r['calibration_path']} (plan uses it for {r['calibration']['accelerator']})")


def _tensor_collectives(tp: dict[str, Any]) -> None:
    """profile with parallel.tensor: each layer's collectives, one micro-batch."""
    table = Table(
        title=f"tensor-parallel collectives of one micro-batch ({tp['micro_batch']} rows), {tp['degree']} ranks, "
        f"{tp['backend']}"
    )
    for col in ("layer", "forward", "backward", "ms"):
        table.add_column(col, justify="left" if col != "ms" else "right")

    def said(kinds: dict[str, dict[str, float]]) -> str:
        return ", ".join(
            f"{k['count']:g} {op.replace('_into_tensor', '').replace('_tensor', '')} {k['bytes'] / 2**10:,.0f} KiB"
            for op, k in sorted(kinds.items())
        )

    for layer, phases in tp["layers"].items():
        seconds = sum(k["seconds"] for kinds in phases.values() for k in kinds.values())
        table.add_row(layer, said(phases.get("forward", {})), said(phases.get("backward", {})), f"{seconds * 1e3:.2f}")
    show_table(table)
    ratio = tp.get("planned_over_measured_bytes")
    out.print(
        f"bus bandwidth achieved {tp['bus_bandwidth'] / 1e9:,.3f} GB/s (kept in the calibration for plan's "
        f"tensor-parallel groups); plan's model moves {tp['planned_bus_bytes_per_micro_batch'] / 2**20:,.2f} MiB a "
        f"micro-batch over each link, measured {tp['bus_bytes_per_micro_batch'] / 2**20:,.2f} MiB"
        + (f" ({ratio:.2f}x)" if ratio else ""),
        highlight=False,
    )


def layers(r: dict[str, Any]) -> None:
    """`profile --layers`: each unit's cost, then each partition's predicted stages."""
    p = r["profile"]
    units = Table(title=f"units on {p['device']}, micro-batch {p['micro_batch']} (median of {p['repetitions']})")
    for column in ("unit", "fwd+bwd (ms)", "output", "saved for backward", "parameters"):
        units.add_column(column, justify="left" if column == "unit" else "right")
    saved = p.get("saved_bytes") or [None] * len(p["units"])
    rows = zip(p["units"], p["seconds"], p["activation_bytes"], saved, p["param_bytes"], strict=True)
    for name, s, a, held, b in rows:
        units.add_row(name, f"{1e3 * s:.2f}", _bytes(a), "–" if held is None else _bytes(held), _bytes(b))
    show_table(units)
    if p.get("p2p_latency_s") is not None:
        out.print(
            f"point to point here: {1e6 * p['p2p_latency_s']:.0f} us latency, {p['p2p_bytes_per_s'] / 1e9:.2f} GB/s",
            highlight=False,
        )
    for c in r["partitions"]:
        table = Table(
            title=f"partition {c['partition']}: step {1e3 * c['step_s']:.1f} ms predicted, slowest stage "
            f"{c['imbalance']:.2f}x the mean"
        )
        for column in ("stage", "units", "fwd+bwd per micro-batch (ms)", "weights+grads+optimizer", "activations"):
            table.add_column(column, justify="left" if column == "units" else "right")
        for k, s in enumerate(c["stages"]):
            table.add_row(
                str(k), s["units"], f"{1e3 * s['seconds_per_micro']:.2f}", _bytes(s["state_bytes"]),
                _bytes(s["activation_bytes"]),
            )  # fmt: skip
        show_table(table)
    if r.get("path"):
        out.print(f"saved: {r['path']} (parallel.pipeline.partition profile reads it)", highlight=False)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def search(s: dict[str, Any]) -> None:
    """`petatrain tune`: the trials, best first, and where the best config and the page are."""
    metric, keys = s["metric"], list(s["params"])
    sign = 1 if s["mode"] == "min" else -1
    best = s["best"]["trial"] if s["best"] else None
    table = Table(title=f"{len(s['trials'])} trials, {metric} ({s['mode']}), {s['scheduler']}")
    for column in ("trial", *keys, metric, "step", "status", "goodput"):
        table.add_column(column, justify="left" if column in ("trial", "status") else "right")

    def order(t: dict[str, Any]) -> tuple[bool, float]:
        value = t[metric]
        return (not isinstance(value, int | float), sign * value if isinstance(value, int | float) else 0.0)

    for t in sorted(s["trials"], key=order):
        table.add_row(
            t["trial"] + (" *" if t["trial"] == best else ""),
            *[_or_dash(t["params"].get(k), "{:.4g}" if isinstance(t["params"].get(k), float) else "{}") for k in keys],
            _or_dash(t[metric], "{:.4f}"),
            _or_dash(t["step"]),
            t["status"] + (f": {t['error']}" if t.get("error") else ""),
            _or_dash(None if t["goodput"] is None else 100 * t["goodput"], "{:.1f}%"),
        )
    show_table(table)
    if best:  # without one, the command's error line says so (exit 1)
        out.print(f"best: trial {best}, {metric} {s['best'][metric]:.4f}: {s['best_config']}", highlight=False)
    out.print(f"search: {s['html']} ({s['wall_s']:.1f} s)", highlight=False)


def training(result: TrainResult) -> None:
    """A finished run: steps, attempts, each fault recovered from, its goodput report."""
    if result.wall_s == 0.0:  # the run had trained to its end already (a retry, --resume): nothing was done
        out.print(
            f"{result.run} had trained {result.steps} steps already: nothing to do", highlight=False, soft_wrap=True
        )
    else:
        out.print(
            f"trained {result.steps} steps in {result.wall_s:.1f}s, {result.attempts} attempt(s)", highlight=False
        )
    for f in result.failures:
        rank = "" if f.rank is None else f" (rank {f.rank})"
        out.print(f"  recovered from {f.cause}{rank}", highlight=False)
    report(result.report.to_dict())
    if result.failures and result.ray_log:
        out.print(f"Ray's own logs: {result.ray_log}; workers': {RAY_SESSION_LOGS}", highlight=False, soft_wrap=True)


def demo_next(result: dict[str, Any]) -> None:
    """What to try after the demo (its tables were printed as it went)."""
    run = result.get("train", {}).get("run", "")
    if not run:  # --no-train: the dataset is what there is
        out.print("\nNext: [bold].venv/bin/petatrain train examples/tiny.yaml[/bold]  (README, Training)")
        return
    out.print(f"\nNext: [bold].venv/bin/petatrain report {run}[/bold]")
    out.print(f"      [bold].venv/bin/petatrain serve {run}[/bold]  (its model over HTTP; README, Serving)")


def keys_created(made: dict[str, Any]) -> None:
    where = "keyring" if made["keyref"].startswith("file:") else "key container"
    mode = " (mode 0600)" if where == "keyring" else ""
    out.print(
        f"{where} {made['keyref']}{mode}: master key version {made['primary']}, signing key {made['key_id']}",
        highlight=False,
        soft_wrap=True,
    )


def public_key(made: dict[str, Any]) -> None:
    out.print(f"verification key {made['key_id']} -> {made['path']}")


def keys_rotated(done: dict[str, Any]) -> None:
    out.print(f"{done['keyref']}: master key version {done['key_version']} is now primary", highlight=False)
    for item in done["rewrapped"]:
        what = item.get("dataset") or item.get("run")
        rest = {k: v for k, v in item.items() if k not in ("dataset", "run")}
        out.print(f"  re-wrapped {what}: {json.dumps(rest)}", highlight=False, soft_wrap=True)
    if done["retired"]:
        out.print(f"  retired versions {', '.join(map(str, done['retired']))}", highlight=False)
        out.print(
            "  data these versions encrypted that was not re-wrapped here or by an earlier rotation of this keyring "
            "can no longer be read",
            highlight=False,
            soft_wrap=True,
        )


def ray_tls(made: dict[str, Any]) -> None:
    out.print(f"wrote {made['folder']}: ca.pem, node.pem, and keys ca.key, node.key (mode 0600)", highlight=False)
    out.print("job config:", highlight=False)
    for key, value in made["config"].items():
        out.print(f"  resources.tls.{key}: {value}", highlight=False, soft_wrap=True)
    out.print("every node, before `ray start`:", highlight=False)
    out.print("  export " + " ".join(f"{k}={v}" for k, v in made["env"].items()), highlight=False, soft_wrap=True)
