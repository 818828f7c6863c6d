"""The run report: `RUN/report.json`, `loss.png`, `timeline.png` and a self-contained `report.html`.

matplotlib is imported only here, and only when a report is drawn, so training workers
that import `petatrain.observe` do not pay for it.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
from typing import Any

from petatrain.observe.goodput import DEFINITIONS, Goodput, account, thin
from petatrain.observe.ledger import load_events
from petatrain.observe.lineage import trained_on
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, listdir, read_bytes

log = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
LOSS_PNG = "loss.png"
TIMELINE_PNG = "timeline.png"

# Past this many points a plot looks the same and takes longer to draw.
_MAX_PLOT_POINTS = 20_000
# Rows beyond this in the HTML checkpoint table are summarised (report.json keeps them all).
_MAX_TABLE_ROWS = 200

_PART_LABELS = {
    "productive_s": "productive (kept steps)",
    "data_wait_s": "data wait",
    "checkpoint_stall_s": "checkpoint stall",
    "fault_detection_s": "fault detection",
    "restart_s": "restart",
    "recomputed_s": "recomputed (lost) steps",
    "startup_s": "start-up",
    "finish_s": "finish",
    "idle_s": "idle",
}


def write_report(run_url: str, options: StorageOptions | None = None) -> dict[str, Any]:
    """Account a run's ledger and write its report files into the run; returns report.json's content."""
    events = load_events(run_url, options)
    goodput = account(events)
    report = goodput.to_dict()
    report["run"] = run_url
    report["trained_on"] = trained_on(events, run_url)  # observe.lineage: the dataset versions it read
    report["communication"] = traced_communication(run_url, options)
    report["files"] = {
        "json": join(run_url, REPORT_JSON),
        "html": join(run_url, REPORT_HTML),
        "loss_png": join(run_url, LOSS_PNG),
        "timeline_png": join(run_url, TIMELINE_PNG),
    }
    loss_png = plot_loss(goodput)
    timeline_png = plot_timeline(goodput)
    atomic_write(report["files"]["loss_png"], loss_png, options)
    atomic_write(report["files"]["timeline_png"], timeline_png, options)
    page = render_html(report, loss_png, timeline_png)
    atomic_write(report["files"]["html"], page.encode("utf-8"), options)
    atomic_write(report["files"]["json"], (json.dumps(report, indent=2) + "\n").encode("utf-8"), options)
    log.info("report of %s: goodput %.1f%%", run_url, 100 * goodput.goodput)
    return report


def traced_communication(run_url: str, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """Each traced rank's communication per mesh dimension (observe.profile_at: RUN/traces/attempt-K/
    rank-R.summary.json, train.trace), by attempt and rank; a summary that does not parse is left out."""
    out = []
    for url in listdir(join(run_url, "traces"), options):
        folder, _, name = url.rpartition("/")
        if not name.endswith(".summary.json"):
            continue
        try:
            attempt = int(folder.rpartition("/")[2].removeprefix("attempt-"))
            summary = json.loads(read_bytes(url, options))
            comm = summary.get("communication_by_dimension")
            if comm:
                keys = ("rank", "first_step", "steps", "step_ms")
                out.append({"attempt": attempt, **{k: summary[k] for k in keys}, **comm})
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("trace summary %s left out of the report: %s", url, exc)
    return sorted(out, key=lambda c: (c["attempt"], c["rank"]))


def plot_loss(goodput: Goodput) -> bytes:
    """PNG of the training loss of the kept steps, with the evaluation points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        curve = thin(goodput.loss_curve, _MAX_PLOT_POINTS)
        if curve:
            ax.plot([s for s, _ in curve], [loss for _, loss in curve], lw=1.2, color="tab:blue", label="train loss")
        if goodput.evals:
            ax.plot(
                [e["step"] for e in goodput.evals],
                [e["loss"] for e in goodput.evals],
                "o-",
                ms=4,
                color="tab:orange",
                label="eval loss",
            )
        if curve or goodput.evals:
            ax.legend(loc="upper right")
        else:
            ax.text(0.5, 0.5, "no steps recorded yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.set_ylabel("loss")
        ax.set_title(f"loss — {goodput.run_id or 'run'}")
        ax.grid(alpha=0.3)
        return _png(fig)
    finally:
        plt.close(fig)


def plot_timeline(goodput: Goodput) -> bytes:
    """PNG of step progress against wall time: one line per attempt, recomputed steps,
    detection (orange) and restart (grey) windows around each failure, and checkpoints."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    try:
        attempts = sorted({p.attempt for p in goodput.timeline})
        for attempt in attempts:
            points = thin([p for p in goodput.timeline if p.attempt == attempt], _MAX_PLOT_POINTS)
            ax.plot([p.t_s for p in points], [p.step for p in points], lw=1.5, label=f"attempt {attempt + 1}")
        lost = [p for p in goodput.timeline if not p.kept]
        if lost:
            ax.scatter(
                [p.t_s for p in lost], [p.step for p in lost], s=10, color="red", zorder=3, label="recomputed steps"
            )
        committed = [c for c in goodput.checkpoints if c.committed]
        pending = [c for c in goodput.checkpoints if not c.committed]
        if committed:
            ax.scatter(
                [c.t_s for c in committed],
                [c.step for c in committed],
                marker="^",
                s=40,
                color="green",
                zorder=4,
                label="checkpoint (committed)",
            )
        if pending:
            ax.scatter(
                [c.t_s for c in pending],
                [c.step for c in pending],
                marker="^",
                s=40,
                facecolors="none",
                edgecolors="green",
                zorder=4,
                label="checkpoint (not committed)",
            )
        for n, fault in enumerate(goodput.faults):
            first = n == 0
            if fault.detected_after_s:
                ax.axvspan(
                    fault.t_s - fault.detected_after_s,
                    fault.t_s,
                    color="orange",
                    alpha=0.3,
                    label="fault detection" if first else None,
                )
            if fault.restart_s:
                ax.axvspan(
                    fault.t_s, fault.t_s + fault.restart_s, color="grey", alpha=0.3, label="restart" if first else None
                )
            ax.axvline(fault.t_s, color="red", ls="--", lw=1, label="failure" if first else None)
            ax.annotate(
                fault.cause,
                (fault.t_s, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                color="red",
                fontsize=8,
            )
        if not goodput.timeline:
            ax.text(0.5, 0.5, "no steps recorded yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlim(0, max(goodput.wall_s, 1e-9))
        ax.set_xlabel("wall time since run start (s)")
        ax.set_ylabel("step")
        ax.yaxis.set_major_locator(_integer_ticks())
        ax.set_title(f"progress — goodput {100 * goodput.goodput:.1f}%")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
        return _png(fig)
    finally:
        plt.close(fig)


def render_html(report: dict[str, Any], loss_png: bytes, timeline_png: bytes) -> str:
    """A self-contained page: summary, time split, faults, checkpoints, both plots inlined."""
    e = html.escape
    wall = report["wall_s"] or 0.0
    split_rows = [
        [
            _PART_LABELS.get(name, name), f"{seconds:.3f}", f"{100 * seconds / wall:.1f}%" if wall > 0 else "–",
            DEFINITIONS.get(name, ""),
        ]
        for name, seconds in report["time"].items()
    ]  # fmt: skip
    title = e(str(report.get("run_id") or report.get("run") or ""))
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>petatrain report — {title}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Run report — {title}</h1>",
        _table(["", ""], _summary_rows(report), cls="summary"),
    ]
    if report["note"]:
        parts.append(f'<p class="note">{e(report["note"])}</p>')
    if report.get("trained_on"):
        rows = [
            [r["dataset"], "" if r["version"] is None else f"v{r['version']}", r["kind"], f"{r['rows']:,}"]
            for r in report["trained_on"]
        ]
        parts += ["<h2>Trained on</h2>", _table(["dataset", "version", "rows", "count"], rows)]
    parts += [
        "<h2>Where the wall time went</h2>",
        _table(["part", "seconds", "share of wall", "what it is"], split_rows),
        _img("timeline", timeline_png),
        "<h2>Faults</h2>",
        _faults_table(report["faults"]),
        "<h2>Loss</h2>",
        _img("loss curve", loss_png),
        "<h2>Checkpoints</h2>",
        *_checkpoints_html(report["checkpoints"]),
    ]
    if report.get("pipeline"):
        parts += ["<h2>Pipeline stages</h2>", *_pipeline_html(report["pipeline"])]
    if report.get("communication"):
        parts += ["<h2>Communication by mesh dimension</h2>", *_communication_html(report["communication"])]
    if report["checkpoints_skipped"]:
        parts += [
            "<h2>Checkpoints skipped at resume</h2>",
            _table(["url", "reason"], [[s["url"] or "", s["reason"] or ""] for s in report["checkpoints_skipped"]]),
        ]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _summary_rows(report: dict[str, Any]) -> list[list[str]]:
    steps, wall = report["steps"], report["wall_s"] or 0.0
    return [
        ["run", report.get("run") or ""],
        ["status", report["status"]],
        ["goodput", f"{100 * report['goodput']:.1f}%"],
        ["wall time", f"{wall:.1f} s"],
        ["steps kept / target", f"{steps['kept']} / {steps['target'] if steps['target'] is not None else '?'}"],
        ["steps recomputed", str(steps["recomputed"])],
        ["attempts", str(report["attempts"])],
        ["tokens kept", f"{report['tokens_kept']} ({report['tokens_per_s']:.1f}/s of wall time)"],
    ]


def _img(alt: str, png: bytes) -> str:
    return f'<img alt="{alt}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


_FAULT_COLUMNS = [
    "cause", "rank", "attempt", "step", "at (s)", "detected after (s)", "recovered after (s)", "steps lost", "detail",
]  # fmt: skip


def _faults_table(faults: list[dict[str, Any]]) -> str:
    rows = [_fault_row(f) for f in faults]
    return _table(_FAULT_COLUMNS, rows, cls="faults") if rows else "<p>No faults.</p>"


def _pipeline_html(p: dict[str, Any]) -> list[str]:
    measured, theory = p.get("bubble_measured"), p.get("bubble_theory") or 0.0
    shape = f"{p.get('schedule')}, {p.get('stages')} stages x {p.get('chunks')} chunks"
    bubble = f"{measured:.1%}" if measured is not None else "not measured"
    head = ["rank", "units", "steps", "compute (s)", "idle", "predicted (s)", "error", "gradient reduce (s)"]
    head += ["memory (MiB): state + activations", "predicted", "error"]
    rows = [_stage_row(s) for s in p["stages_measured"]]
    summary = f"{shape}, {p.get('microbatches')} micro-batches: bubble {bubble} measured, {theory:.1%} in theory"
    return [f"<p>{html.escape(summary)} ((P-1)/(vM+P-1)).</p>", _table(head, rows)]


def _stage_row(s: dict[str, Any]) -> list[str]:
    measured = [str(s["steps"]), f"{s['busy_s']:.2f}", _pct(s["idle_share"])]
    return [
        str(s["rank"]),
        ", ".join(s["units"] or []),
        *measured,
        _num(s["predicted_busy_s"]),
        _pct(s["prediction_error"], sign=True),
        _num(s.get("reduce_s")),
        _mib(s.get("state_bytes"), s.get("activation_bytes")),
        _mib(s.get("predicted_state_bytes"), s.get("predicted_activation_bytes")),
        _pct(s.get("memory_error"), sign=True),
    ]


def step_span(first: int, steps: int) -> str:
    """A traced window's steps as a table shows them: "29-30", or "30" for one."""
    last = first + steps - 1
    return f"{first}-{last}" if last > first else str(last)


def _communication_html(traced: list[dict[str, Any]]) -> list[str]:
    note = (
        "The traced steps (observe.profile_at) of each rank, per step: each dimension's collectives, the"
        " MiB handed to them and their time as the backend ran them (gloo: on the group's own threads, so"
        " overlapped work counts in full; sends and receives are the pipeline's)."
    )
    head = ["attempt", "rank", "steps", "step (ms)", "dimension", "collectives", "MiB", "ms", "share of step"]
    rows = []
    for t in traced:
        where = [str(t["attempt"] + 1), str(t["rank"]), step_span(t["first_step"], t["steps"])]
        dimensions = sorted(t["dimensions"].items())
        if t.get("unattributed_ms"):
            dimensions.append(("unattributed", {"calls": None, "mib": None, "ms": t["unattributed_ms"]}))
        for dimension, d in dimensions:
            ms = d["ms"]
            share = None if ms is None or not t["step_ms"] else ms / t["step_ms"]
            counts = ["" if d[k] is None else format(d[k], f) for k, f in (("calls", "g"), ("mib", ".3f"))]
            rows.append([*where, f"{t['step_ms']:.1f}", dimension, *counts, _num(ms), _pct(share)])
    dropped = [f"{t['attempt'] + 1}/{t['rank']}" for t in traced if not t.get("complete", True)]
    if dropped:
        note += f" Attempt/rank {', '.join(dropped)}: the flight recorder dropped collectives of the window."
    return [f"<p>{html.escape(note)}</p>", _table(head, rows)]


def _mib(state: int | None, activations: int | None) -> str:
    if state is None or activations is None:
        return "–"
    return f"{(state + activations) / 2**20:.1f} = {state / 2**20:.1f} + {activations / 2**20:.1f}"


def _pct(value: float | None, *, sign: bool = False) -> str:
    return "–" if value is None else (f"{value:+.1%}" if sign else f"{value:.1%}")


def _fault_row(f: dict[str, Any]) -> list[str]:
    times = [_num(f[t]) for t in ("t_s", "detected_after_s", "recovered_after_s")]
    where = [_cell(f["rank"]), str(f["attempt"] + 1), _cell(f["step"])]
    return [f["cause"], *where, *times, _cell(f["steps_lost"]), f["detail"]]


def _checkpoint_row(c: dict[str, Any]) -> list[str]:
    write = [_num(c["t_s"]), f"{c['stall_s']:.3f}", "yes" if c["committed"] else "no", _num(c["write_s"])]
    return [str(c["step"]), str(c["attempt"] + 1), *write, _cell(c["bytes"]), c["url"] or ""]


def _checkpoints_html(checkpoints: list[dict[str, Any]]) -> list[str]:
    """The newest checkpoints' table (all of them are in report.json)."""
    rows = [_checkpoint_row(c) for c in checkpoints[-_MAX_TABLE_ROWS:]]
    if not rows:
        return ["<p>No checkpoints.</p>"]
    head = ["step", "attempt", "at (s)", "stall (s)", "committed", "write (s)", "bytes", "url"]
    shown = [f"<p>The last {_MAX_TABLE_ROWS} of {len(checkpoints)} (all are in report.json).</p>"]
    return (shown if len(checkpoints) > _MAX_TABLE_ROWS else []) + [_table(head, rows)]


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}"
    "th{background:#f3f3f3}img{max-width:100%;display:block;margin:1em 0}.note{color:#a60}"
    "table.summary th{display:none}"
)


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    return "–" if value is None else str(value)


def _num(value: float | None) -> str:
    """Seconds or milliseconds in a table: two decimals, or a dash for none."""
    return "–" if value is None else f"{value:.2f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# -- a search's page (petatrain tune) -------------------------------------------------------------


def write_search_report(summary: dict[str, Any], url: str, options: StorageOptions | None = None) -> str:
    """`OUT/tune.html`: the trials' table and every trial's evaluation curve on one plot, with the
    scheduler's decisions marked (a trial ASHA stopped, a trial PBT continued from another)."""
    page = render_search_html(summary, plot_search(summary))
    atomic_write(url, page.encode("utf-8"), options)
    return url


def plot_search(summary: dict[str, Any]) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    metric = summary["metric"]
    try:
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        color = {t["trial"]: colors[i % len(colors)] for i, t in enumerate(summary["trials"])}
        for t in summary["trials"]:
            if t["curve"]:
                best = summary["best"] and summary["best"]["trial"] == t["trial"]
                nan = float("nan")  # [None, None]: a PBT exploit, where the line breaks
                xs, ys = zip(*((nan, nan) if s is None else (s, v) for s, v in t["curve"]), strict=True)
                label = f"{t['trial']}{' (best)' if best else ''}"
                ax.plot(xs, ys, "o-", ms=3, lw=2.4 if best else 1.2, color=color[t["trial"]], label=label)
        at = {t["trial"]: {s: v for s, v in t["curve"] if s is not None} for t in summary["trials"]}
        marked: set[str] = set()
        for d in summary["decisions"]:
            value = at.get(d["trial"], {}).get(d["step"])
            if value is None:
                continue
            if d["decision"] == "stopped":
                kind = f"stopped ({d['by']})"
                ax.plot([d["step"]], [value], "X", ms=11, color="black", label=None if kind in marked else kind)
            else:
                kind = "exploit (pbt)"
                ax.plot(
                    [d["step"]], [value], "*", ms=14, mfc="none", mec="black", label=None if kind in marked else kind
                )
                ax.annotate(
                    f"← {d['from']}", (d["step"], value), fontsize=7, xytext=(6, -10), textcoords="offset points"
                )
            marked.add(kind)
        if any(t["curve"] for t in summary["trials"]):
            ax.legend(loc="upper right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no evaluation reported", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} of every trial — {summary['scheduler']}, {summary['search']}")
        ax.grid(alpha=0.3)
        return _png(fig)
    finally:
        plt.close(fig)


def render_search_html(summary: dict[str, Any], png: bytes) -> str:
    e = html.escape
    metric, keys = summary["metric"], list(summary["params"])
    best = summary["best"]["trial"] if summary["best"] else None
    rows = [
        [
            t["trial"] + (" (best)" if t["trial"] == best else ""),
            *[_param(t["params"].get(k)) for k in keys],
            _param(t[metric]),
            _cell(t["step"]),
            t["status"],
            "–" if t["goodput"] is None else f"{100 * t['goodput']:.1f}%",
            t["run"],
        ]
        for t in summary["trials"]
    ]
    decisions = [
        [d["trial"], str(d["step"]), d["decision"], d.get("from") or d.get("by") or ""] for d in summary["decisions"]
    ]
    spaces = [[k, v] for k, v in summary["params"].items()]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>petatrain search — {e(summary['out'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Search — {e(summary['out'])}</h1>",
        _table(
            ["", ""],
            [
                ["metric", f"{metric} ({summary['mode']})"],
                ["scheduler, search", f"{summary['scheduler']}, {summary['search']}"],
                ["trials, at once", f"{len(summary['trials'])}, {summary['concurrent']}"],
                ["steps per trial", str(summary["steps"])],
                ["wall time", f"{summary['wall_s']:.1f} s"],
                ["best", f"{best} ({_param(summary['best'][metric])})" if best else "–"],
            ],
            cls="summary",
        ),
        "<h2>Spaces</h2>",
        _table(["field", "space"], spaces),
        "<h2>Trials</h2>",
        _table(["trial", *keys, metric, "step", "status", "goodput", "run"], rows),
        _img(f"{metric} of every trial", png),
        "<h2>Scheduler decisions</h2>",
        _table(["trial", "step", "decision", "from / by"], decisions) if decisions else "<p>None.</p>",
        "</body></html>\n",
    ]
    return "\n".join(parts)


def _param(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return _cell(value)
