"""torch.profiler over a few training steps of every rank (`observe.profile_at`, `observe.profile_steps`):
where a step's time goes, as torchtitan's profiling section records it.

Each rank writes, under `RUN/traces/attempt-K/`, a Chrome trace (`rank-R.json.gz`, opens in Perfetto or
chrome://tracing) and a summary (`rank-R.summary.json`): the traced steps' wall time per step, the time
per step inside each of the loop's phases (the `span`s below: data, forward and backward, gradient
reduction, clipping, optimizer, the shared flags, telemetry, checkpoints), and the operators that took
the most time of their own (`self_ms`). Outside a traced window a span costs one attribute read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

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
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        _active = False
        try:
            self._write(profiler, wall, self.last - self.first + 1, thread)
        except Exception as exc:  # a trace is for diagnosis: the run trains on without it
            log.warning("the trace of steps %d-%d was not written: %s", self.first, self.last, exc)

    def _write(self, profiler: Any, wall_s: float, steps: int, thread: dict[str, float]) -> None:
        summary = summarize(profiler.key_averages(), wall_s, steps, prefix=self.prefix, thread=thread)
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
