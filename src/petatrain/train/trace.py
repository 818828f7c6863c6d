"""torch.profiler over a few training steps of every rank (`observe.profile_at`, `observe.profile_steps`):
where a step's time goes, as torchtitan's profiling section records it.

Each rank writes, under `RUN/traces/attempt-K/`, a Chrome trace (`rank-R.json.gz`, opens in Perfetto or
chrome://tracing) and a summary (`rank-R.summary.json`): the traced steps' wall time per step, the time
per step inside each of the loop's phases (the `span`s below: data, forward and backward, gradient
reduction, clipping, optimizer, the shared flags, telemetry, checkpoints), and the operators that took
the most time of their own (`self_ms`), and the communication of each dimension of the mesh
(`communication_by_dimension`: tensor, data, pipeline, tied weights, world). Outside a traced window a
span costs one attribute read.

Which dimension a collective belongs to is not in the profiler's events: gloo's and NCCL's carry no
process group. torch's flight recorder (on by default, the last 2,000 collectives of the process) has
the group of every collective, its inputs' sizes and when it was issued; gloo runs a group's
collectives on threads of its own. So each gloo event is matched to the recorder's entry issued
last before it started, among the groups whose next entry has the event's name, and each thread goes
to the group most of its events matched: its events' time is that group's. Gloo's sends and receives
are not in the recorder; in petatrain only a pipeline's stages send and receive, so theirs is the
pipeline's. NCCL's collectives run on the device: their calls and bytes come from the recorder, their
time only where the recorder times them (TORCH_NCCL_ENABLE_TIMING=1 in the workers' environment; not
checked here, on CPU only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import tempfile
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from petatrain.storage.fs import atomic_write, join

log = logging.getLogger(__name__)

_active = False  # a trace is being recorded in this process: spans are labelled


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A phase of the step, named in the trace while one is recorded; nothing otherwise."""
    return torch.profiler.record_function(name) if _active else contextlib.nullcontext()


def spanned(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, each call of it a `span`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with span(name):
            return fn(*args, **kwargs)

    return call


class StepTracer:
    """Records steps [at, at + steps) of this rank (1-based step numbers, as the ledger's), then writes
    them to `run_url`/traces/attempt-K. A run resumed past `at` traces nothing."""

    def __init__(
        self,
        at: int,
        steps: int,
        *,
        rank: int,
        attempt: int,
        run_url: str,
        options: Any = None,
        prefix: str = "petatrain.",
    ):
        self.first, self.last, self.prefix = at, at + steps - 1, prefix  # `prefix`: of the spans summarized
        self.rank, self.folder, self.options = rank, join(run_url, "traces", f"attempt-{attempt}"), options
        self.profiler: Any = None
        self.started, self.usage = 0.0, resource.struct_rusage((0,) * 16)  # the window's start (set in before)
        self.started_ns = 0  # the window's start, unix time: the flight recorder's clock

    def before(self, step: int) -> None:
        """Called before step `step` (1-based) runs."""
        global _active
        if step != self.first or not self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        _active, self.started, self.usage = True, time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
        self.started_ns = time.time_ns()

    def after(self, step: int) -> None:
        """Called once step `step` is over (its checkpoint and evaluation included)."""
        global _active
        if self.profiler is None or step != self.last:
            return
        wall, now = time.perf_counter() - self.started, resource.getrusage(resource.RUSAGE_THREAD)
        # The training thread's CPU, and the times the kernel took its core away (involuntary context
        # switches: another thread or process ran).
        before = self.usage
        thread = {
            "cpu_s": (now.ru_utime + now.ru_stime) - (before.ru_utime + before.ru_stime),
            "preempted": now.ru_nivcsw - before.ru_nivcsw,
        }
        window = (self.started_ns, time.time_ns())
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        _active = False
        try:
            self._write(profiler, wall, self.last - self.first + 1, thread, window)
        except Exception as exc:  # a trace is for diagnosis: the run trains on without it
            log.warning("the trace of steps %d-%d was not written: %s", self.first, self.last, exc)

    def _write(
        self, profiler: Any, wall_s: float, steps: int, thread: dict[str, float], window: tuple[int, int]
    ) -> None:
        summary = summarize(profiler.key_averages(), wall_s, steps, prefix=self.prefix, thread=thread)
        summary["communication_by_dimension"] = _by_dimension(profiler, window, steps)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json.gz")
            profiler.export_chrome_trace(path)  # gzipped by torch, for the name
            with open(path, "rb") as f:
                trace = f.read()
        atomic_write(join(self.folder, f"rank-{self.rank}.json.gz"), trace, self.options)
        body = json.dumps({"rank": self.rank, "first_step": self.first, **summary}, indent=1).encode()
        atomic_write(join(self.folder, f"rank-{self.rank}.summary.json"), body, self.options)


# Operators whose time is a collective or a point-to-point transfer (gloo's and NCCL's names as the
# profiler records them: c10d's functions, the ProcessGroup's record functions, the waits).
_COMMUNICATION = ("c10d", "gloo", "nccl", "send", "recv", "all_reduce", "allreduce", "broadcast", "all_gather",
                  "allgather", "reduce_scatter", "_reduce_scatter", "barrier", "wait")  # fmt: skip


def summarize(averages: Any, wall_s: float, steps: int, *, prefix: str, thread: dict[str, float]) -> dict[str, Any]:
    """A profiler's `key_averages()` as ms per step: each span (`prefix`ed names) with its calls, the
    time in communication operators, the 15 operators with the most time of their own, and the
    training thread's CPU ms and involuntary context switches (`thread`: cpu_s, preempted)."""
    per_step = 1.0 / (1000.0 * steps)  # profiler times are microseconds
    spans, operators, communication = {}, [], 0.0
    for row in averages:
        if row.key.startswith(prefix):
            spans[row.key.removeprefix(prefix)] = {
                "ms": round(row.cpu_time_total * per_step, 3), "calls": row.count / steps,
            }  # fmt: skip
            continue
        if any(word in row.key.lower() for word in _COMMUNICATION):
            communication += row.self_cpu_time_total
        operators.append((row.self_cpu_time_total, row.key, row.count))
    operators.sort(reverse=True)
    return {
        "steps": steps,
        "step_ms": round(wall_s * 1000.0 / steps, 3),
        "cpu_ms": round(thread["cpu_s"] * 1000.0 / steps, 3),
        "preempted_per_step": round(thread["preempted"] / steps, 2),
        "spans_ms": spans,
        "communication_self_ms": round(communication * per_step, 3),
        "top_self_ms": [
            {"op": key, "ms": round(us * per_step, 3), "calls": count / steps} for us, key, count in operators[:15]
        ],
    }


class Work(NamedTuple):
    """One event of the backend's work in a trace: gloo's `gloo:all_reduce`, `gloo:send`..."""

    name: str
    thread: int  # the profiler's thread id
    start_ns: int  # unix time, as the flight recorder's
    us: float


# The flight recorder's dtype names, and their bytes
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}  # fmt: skip
# A group's description (DeviceMesh names its groups mesh_<dimension>) -> the dimension it is
_DIMENSIONS = {"mesh_tp": "tensor", "mesh_tensor": "tensor", "mesh_dp": "data", "mesh_data": "data",
               "mesh_pp": "pipeline", "tied": "tied weights", "default_pg": "world"}  # fmt: skip
# gloo's flight recorder, and NCCL's where torch is built with it (a recorder of its own): their JSON dumps
FLIGHT_RECORDERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
_P2P = ("gloo:send", "gloo:recv")  # not in the flight recorder; only a pipeline's stages send and receive
_SLACK_NS = 50_000  # the profiler's clock against the recorder's (both unix time, read apart)


def _by_dimension(profiler: Any, window: tuple[int, int], steps: int) -> dict[str, Any] | None:
    """This window's communication per dimension of the mesh (see the module's docstring), None without
    a process group or a flight recorder."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        import torch._C._distributed_c10d as c10d

        entries: list[dict[str, Any]] = []
        for dump in [getattr(c10d, name) for name in FLIGHT_RECORDERS if hasattr(c10d, name)]:
            entries += json.loads(dump(includeCollectives=True, onlyActive=False)).get("entries") or []
        base = profiler.profiler.kineto_results.trace_start_ns()
    except Exception as exc:  # an older or newer torch: the rest of the summary stands
        log.warning("communication per dimension not measured: %s", exc)
        return None
    work = [
        Work(e.name, e.thread, base + int(e.time_range.start * 1000), e.time_range.elapsed_us())
        for e in profiler.events()
        if e.name.startswith("gloo:")  # NCCL's run on the device: only the recorder can time them
    ]
    return communication_by_dimension(work, entries, window, steps)


def communication_by_dimension(
    work: Sequence[Work], entries: Sequence[dict[str, Any]], window: tuple[int, int], steps: int
) -> dict[str, Any]:
    """Per dimension, per step: its collectives (`calls`), their inputs' MiB, and their time (`ms`; None
    where unknown), from the backend's `work` in a traced window and the flight recorder's `entries`
    issued in it. `unattributed_ms`: work on threads no entry matched. `complete`: False if the
    recorder's buffer dropped entries of the window (their calls and bytes are then missing). `timed`
    (where the recorder times collectives itself): how many of the window's entries it had timed."""
    lo, hi = window
    in_window = (e for e in entries if lo <= e["time_created_ns"] <= hi)
    issued = sorted(in_window, key=lambda e: (e["time_created_ns"], e["record_id"]))
    size = int(os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or 2000)
    complete = len(entries) < size or any(e["time_created_ns"] < lo for e in entries)
    out: dict[str, dict[str, Any]] = {}

    def row(group: tuple[str, str] | None) -> dict[str, Any]:
        desc = "" if group is None else group[1]
        dimension = "pipeline" if group is None else _DIMENSIONS.get(desc) or _unnamed(desc)
        return out.setdefault(dimension, {"calls": 0.0, "mib": 0.0, "ms": None})

    for e in issued:
        r = row(tuple(e["process_group"]))
        r["calls"] += 1
        r["mib"] += _bytes(e) / 2**20
    timed = [e for e in issued if e.get("duration_ms") is not None]
    if timed:  # the recorder timed them (NCCL with timing): those its watchdog had seen end
        for e in timed:
            r = row(tuple(e["process_group"]))
            r["ms"] = (r["ms"] or 0.0) + e["duration_ms"]
        unattributed = 0.0
    else:
        unattributed = _attribute(work, issued, row)
    for r in out.values():
        r["calls"] = round(r["calls"] / steps, 2)
        r["mib"] = None if r["mib"] is None else round(r["mib"] / steps, 3)
        r["ms"] = None if r["ms"] is None else round(r["ms"] / steps, 3)
    result = {"dimensions": out, "unattributed_ms": round(unattributed / steps, 3), "complete": complete}
    if timed:
        result["timed"] = [len(timed), len(issued)]  # the entries the recorder had timed, of those issued
    return result


def _attribute(work: Sequence[Work], issued: Sequence[dict[str, Any]], row: Callable[..., dict[str, Any]]) -> float:
    """Adds the time of `work` to its dimension's row (ms); returns the ms of work no group claimed."""
    p2p = [w for w in work if w.name in _P2P]
    if p2p:
        r = row(None)
        r["ms"] = (r["ms"] or 0.0) + sum(w.us for w in p2p) / 1000.0
        if not any(e.get("is_p2p") for e in issued):  # gloo's are not recorded: counted from the events
            r["calls"] += len(p2p)
            r["mib"] = r["mib"] or None  # their sizes unknown
    pending: dict[tuple[str, str], deque[dict[str, Any]]] = defaultdict(deque)
    for e in issued:
        if not e.get("is_p2p"):
            pending[tuple(e["process_group"])].append(e)
    votes: dict[int, Counter[tuple[str, str]]] = defaultdict(Counter)
    collectives = sorted((w for w in work if w.name not in _P2P), key=lambda w: w.start_ns)
    for w in collectives:
        heads = [(q[0]["time_created_ns"], g) for g, q in pending.items() if q and q[0]["profiling_name"] == w.name]
        # issued last before it started (an idle group starts its work at once); within the clocks'
        # slack after it only if none was issued before
        near = [h for h in heads if h[0] <= w.start_ns] or [h for h in heads if h[0] <= w.start_ns + _SLACK_NS]
        if near:
            group = max(near)[1]
            pending[group].popleft()
            votes[w.thread][group] += 1
    owner = {thread: counts.most_common(1)[0][0] for thread, counts in votes.items()}
    unattributed = 0.0
    for w in collectives:
        if w.thread in owner:
            r = row(owner[w.thread])
            r["ms"] = (r["ms"] or 0.0) + w.us / 1000.0
        else:
            unattributed += w.us / 1000.0
    return unattributed


def _unnamed(desc: str) -> str:
    """A group petatrain did not name: torch's description as it is ("undefined" for none given: other)."""
    return "other" if desc in ("", "undefined") else desc


def _bytes(entry: dict[str, Any]) -> int:
    total = 0
    for sizes, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False):
        count = 1
        for n in sizes:
            count *= n
        total += count * _DTYPE_BYTES.get(dtype, 4)
    return total
