"""Goodput accounting: where a run's wall time went, computed from its event ledger.

`account(events)` is a pure function of a run's events (`observe.events` classes, or the
ledger's lines, which it reads through `events.read`). The wall time (run_start to end, or
to the last event while a run is in progress) is split into parts that do not overlap:

    productive        step time of the steps kept in the final model, data wait excluded
    data_wait         data wait of the kept steps
    checkpoint_stall  what the training loop paid for every checkpoint snapshot (and staging wait)
    fault_detection   per failure: from the fault to the moment it was noticed
    restart           per failure: from the failure to the start of the next attempt's first step
    recomputed        step time of step occurrences that a later attempt redid (lost work)
    startup           from a driver's start (run_start, run_continue) to its first step: the driver,
                      Ray, the worker group, the data's first shards (what a restart's own start-up
                      is counts as restart)
    finish            from the last step to the end: the final save, the report
    idle              the rest: evaluations, gaps; never negative

A step "kept" is the last occurrence of its step number in the ledger; every earlier
occurrence was lost to a fault and is recomputed time. goodput = productive / wall.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from petatrain.observe import events as ev
from petatrain.observe.events import Event

# report.json stays small for long runs: the loss curve is thinned to this many points.
MAX_CURVE_POINTS = 5000

_TIME_PARTS = (
    "productive_s",
    "data_wait_s",
    "checkpoint_stall_s",
    "fault_detection_s",
    "restart_s",
    "recomputed_s",
    "startup_s",
    "finish_s",
    "idle_s",
)

# One line each, under the table `report` prints and in report.html: what a part holds.
DEFINITIONS = {
    "productive_s": "step time of the steps kept in the final model, data wait excluded (goodput = this / wall)",
    "data_wait_s": "time the kept steps waited for their batches",
    "checkpoint_stall_s": "what the training loop paid for checkpoint snapshots",
    "fault_detection_s": "from each fault to the moment it was noticed",
    "restart_s": "from each failure to the first step of the next attempt",
    "recomputed_s": "steps lost to faults and done again",
    "startup_s": "from a driver's start to its first step: the driver, Ray, the worker group, the first shards",
    "finish_s": "from the last step to the end: the final save and the report",
    "idle_s": "the rest: evaluations and gaps",
}


@dataclass(kw_only=True, slots=True)
class FaultRecord:
    """One failure: what it was, when it was noticed, when training was productive again."""

    cause: str
    rank: int | None
    attempt: int
    step: int | None  # the step at which it happened (injected step, else the last step reached)
    t_s: float  # failure time, seconds since the run started (a checkpoint drain's start, if one came first)
    detected_after_s: float | None  # fault -> failure; None when nothing says when the fault happened
    recovered_after_s: float | None  # failure -> first step of the next attempt done; None if none came
    restart_s: float  # failure -> start of the next attempt's first step (the part counted as restart)
    steps_lost: int | None  # last step reached in the failed attempt - step the next attempt resumed from
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "rank": self.rank,
            "attempt": self.attempt,
            "step": self.step,
            "t_s": _round(self.t_s),
            "detected_after_s": _round(self.detected_after_s),
            "recovered_after_s": _round(self.recovered_after_s),
            "restart_s": _round(self.restart_s),
            "steps_lost": self.steps_lost,
            "detail": self.detail,
        }


@dataclass(kw_only=True, slots=True)
class CheckpointRecord:
    """A checkpoint snapshot and, once written, its commit."""

    step: int
    attempt: int
    t_s: float  # snapshot time, seconds since the run started
    stall_s: float
    committed: bool = False
    write_s: float | None = None
    bytes: int | None = None
    url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "t_s": _round(self.t_s),
            "stall_s": _round(self.stall_s),
            "committed": self.committed,
            "write_s": _round(self.write_s),
            "bytes": self.bytes,
            "url": self.url,
        }


@dataclass(slots=True)  # positional and not frozen: one per step of a long run, built fast
class StepPoint:
    """One step occurrence, for plots: when it ended, which step, in which attempt."""

    t_s: float
    step: int
    attempt: int
    loss: float | None
    kept: bool


@dataclass(kw_only=True, slots=True)
class Goodput:
    """The accounting of one run (see the module docstring for what each part means)."""

    run_id: str | None = None
    status: str = "running"  # ok | failed | running (no end event yet)
    wall_s: float = 0.0
    productive_s: float = 0.0
    data_wait_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    fault_detection_s: float = 0.0
    restart_s: float = 0.0
    recomputed_s: float = 0.0
    startup_s: float = 0.0
    finish_s: float = 0.0
    idle_s: float = 0.0
    note: str = ""
    steps_target: int | None = None
    steps_kept: int = 0
    steps_recomputed: int = 0
    last_step: int | None = None
    tokens_kept: int = 0
    attempts: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    checkpoints_skipped: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # step, loss, t_s of the kept evals
    pipeline: dict[str, Any] | None = None  # per-stage compute and the bubble, for a pipeline run
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of kept steps
    timeline: list[StepPoint] = field(default_factory=list)  # every step occurrence, for the plot

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Kept tokens per second of wall time: the throughput that ends up in the model."""
        return self.tokens_kept / self.wall_s if self.wall_s > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        """The parts of the wall time, in seconds, in the order they are reported."""
        return {name: getattr(self, name) for name in _TIME_PARTS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "status": self.status,
            "goodput": _round(self.goodput),
            "wall_s": _round(self.wall_s),
            "time": {name: _round(value) for name, value in self.time_split().items()},
            "note": self.note,
            "steps": {
                "target": self.steps_target,
                "kept": self.steps_kept,
                "recomputed": self.steps_recomputed,
                "last": self.last_step,
            },
            "tokens_kept": self.tokens_kept,
            "tokens_per_s": _round(self.tokens_per_s),
            "attempts": self.attempts,
            "restarts": max(self.attempts - 1, 0),
            "faults": [f.to_dict() for f in self.faults],
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "checkpoints_skipped": self.checkpoints_skipped,
            "evals": self.evals,
            "pipeline": self.pipeline,
            "loss_curve": [[step, loss] for step, loss in thin(self.loss_curve, MAX_CURVE_POINTS)],
        }


@dataclass(slots=True)
class _Occurrence:
    index: int  # position in the ledger
    t: float
    attempt: int
    step: int
    step_s: float
    data_wait_s: float
    loss: float | None
    tokens: int


def account(events: Iterable[Event | dict[str, Any]]) -> Goodput:
    """Split a run's wall time into goodput and its losses; see the module docstring.

    Robust to what a ledger of a crashed or running run looks like: missing run_start
    (the first event starts the clock), missing end (the last event stops it), events
    without an attempt number (they belong to the attempt in progress), lines that are no
    event of the schema (they only mark the time: `events.read`).
    """
    events = ev.as_events(events)
    g = Goodput()
    if not events:
        g.note = "no events"
        return g

    start_event = next((e for e in events if isinstance(e, ev.RunStart)), None)
    # A run continued by a later driver (`train --resume`) counts to that driver's end and target.
    begun = [i for i, e in enumerate(events) if isinstance(e, ev.RunStart | ev.RunContinue)]
    latest = events[begun[-1]] if begun else None
    end_event = next(
        (e for i, e in reversed(list(enumerate(events))) if isinstance(e, ev.End) and i > (begun or [-1])[-1]), None
    )
    t0 = start_event.t if start_event else min(e.t for e in events)
    t_end = end_event.t if end_event else max(e.t for e in events)
    g.wall_s = max(t_end - t0, 0.0)
    if start_event:
        g.run_id = start_event.run_id or None
    if isinstance(latest, ev.RunStart | ev.RunContinue):
        g.steps_target = latest.steps
    if end_event:
        g.status = end_event.status or "failed"
    unreadable = sum(isinstance(e, ev.Unreadable) for e in events)

    attempts = _attempt_numbers(events)
    g.attempts = len({a for a, _ in attempts})

    # Steps: the last occurrence of each step number is kept, earlier ones were redone.
    occurrences = []
    for i, (e, (attempt, _)) in enumerate(zip(events, attempts, strict=True)):
        if not isinstance(e, ev.Step):
            continue
        occurrences.append(
            _Occurrence(
                index=i,
                t=e.t,
                attempt=attempt,
                step=e.step,
                step_s=max(e.step_s, 0.0),
                data_wait_s=max(e.data_wait_s, 0.0),
                loss=e.loss,
                tokens=e.tokens,
            )
        )
    last_of_step = {o.step: o.index for o in occurrences}
    kept = [o for o in occurrences if last_of_step[o.step] == o.index]
    redone = [o for o in occurrences if last_of_step[o.step] != o.index]
    g.data_wait_s = sum(min(o.data_wait_s, o.step_s) for o in kept)
    g.productive_s = sum(o.step_s for o in kept) - g.data_wait_s
    g.recomputed_s = sum(o.step_s for o in redone)
    g.steps_kept = len(kept)
    g.steps_recomputed = len(redone)
    g.tokens_kept = sum(o.tokens for o in kept)
    g.last_step = max((o.step for o in kept), default=None)
    g.loss_curve = sorted((o.step, o.loss) for o in kept if o.loss is not None)
    g.timeline = [StepPoint(o.t - t0, o.step, o.attempt, o.loss, last_of_step[o.step] == o.index) for o in occurrences]

    g.checkpoints, g.checkpoints_skipped = _checkpoints(events, attempts, t0)
    g.checkpoint_stall_s = sum(c.stall_s for c in g.checkpoints)
    g.evals = _evals(events, attempts, t0)
    g.pipeline = _pipeline(events)

    g.faults = _faults(events, attempts, occurrences, t0, t_end)
    g.fault_detection_s = sum(f.detected_after_s or 0.0 for f in g.faults)
    g.restart_s = sum(f.restart_s for f in g.faults)

    g.startup_s = _startup(events, occurrences, g.faults, t0)
    if occurrences:  # after the last step, and after the last failure's own parts (a run given up)
        last = max([o.t for o in occurrences] + [t0 + f.t_s + f.restart_s for f in g.faults])
        g.finish_s = max(t_end - last, 0.0)
    busy = sum(getattr(g, name) for name in _TIME_PARTS if name != "idle_s")
    g.idle_s = max(g.wall_s - busy, 0.0)
    if busy > g.wall_s + 1e-6:
        g.note = (
            f"the parts add up to {busy:.3f} s, more than the {g.wall_s:.3f} s of wall time "
            "(clocks of different machines disagree, or events overlap); idle is set to 0"
        )
    elif g.status == "running":
        g.note = "no end event: the run is in progress or its driver died; wall time ends at the last event"
    if unreadable:
        unfit = f"{unreadable} ledger line(s) fit no event of this petatrain and only mark the time"
        g.note = f"{g.note}; {unfit}" if g.note else unfit
    return g


def _attempt_numbers(events: Sequence[Event]) -> list[tuple[int, bool]]:
    """(attempt, explicit) for each event; events without one belong to the attempt in progress."""
    current = 0
    out = []
    for e in events:
        attempt = ev.attempt_of(e)
        if attempt is not None and isinstance(e, ev.AttemptStart | ev.Restart | ev.Resume | ev.WorkerStart):
            current = attempt
        out.append((attempt if attempt is not None else current, attempt is not None))
    return out


def _checkpoints(
    events: Sequence[Event], attempts: list[tuple[int, bool]], t0: float
) -> tuple[list[CheckpointRecord], list[dict[str, Any]]]:
    by_key: dict[tuple[int, int], CheckpointRecord] = {}
    skipped = []
    for e, (attempt, _) in zip(events, attempts, strict=True):
        if isinstance(e, ev.CheckpointSnapshot):
            # After its commit when checkpoints are synchronous (the stall is known only then).
            blank = CheckpointRecord(step=e.step, attempt=attempt, t_s=0, stall_s=0)
            record = by_key.setdefault((attempt, e.step), blank)
            record.t_s = e.t - t0
            record.stall_s = max(e.stall_s, 0.0)
        elif isinstance(e, ev.CheckpointStaging) and (attempt, e.step) in by_key:
            # The next step waited for the write to read a live snapshot: stall, not training.
            by_key[(attempt, e.step)].stall_s += max(e.wait_s, 0.0)
        elif isinstance(e, ev.CheckpointCommit):
            # A commit whose snapshot line was lost is still a checkpoint.
            committed = by_key.setdefault(
                (attempt, e.step), CheckpointRecord(step=e.step, attempt=attempt, t_s=e.t - t0, stall_s=0.0)
            )
            committed.committed = True
            committed.write_s = e.write_s
            committed.bytes = e.bytes
            committed.url = e.url
        elif isinstance(e, ev.CheckpointSkipped):
            skipped.append({"url": e.url, "reason": e.reason, "t_s": _round(e.t - t0)})
    return list(by_key.values()), skipped


def _pipeline(events: Sequence[Event]) -> dict[str, Any] | None:
    """Per pipeline rank (one per stage position): compute and wall time summed over its steady reports,
    the idle share of its steps (the bubble, with the waits for its neighbours), its memory (state and
    peak activations, the most any window saw), and the layer profile's predictions beside them."""
    rows: dict[int, dict[str, Any]] = {}
    shape: dict[str, Any] = {}
    reports = [e for e in events if isinstance(e, ev.PipelineStage)]
    # An attempt's first window holds its set-up (shape inference, first allocations): left out when
    # later windows exist, so the table shows the steady state the prediction is for.
    steady = [e for e in reports if not e.warm_up]
    for e in steady or reports:
        row = rows.setdefault(
            e.rank, {"busy_s": 0.0, "wall_s": 0.0, "steps": 0, "predicted_busy_s": 0.0, "reduce_s": 0.0}
        )
        row.update(parts=e.parts, units=e.units, param_bytes=e.param_bytes)
        row["busy_s"] += e.busy_s
        row["wall_s"] += e.wall_s
        row["reduce_s"] = None if e.reduce_s is None or row["reduce_s"] is None else row["reduce_s"] + e.reduce_s
        row["steps"] += e.steps
        predicted = e.predicted_busy_s
        row["predicted_busy_s"] = (
            None if predicted is None or row["predicted_busy_s"] is None else row["predicted_busy_s"] + predicted
        )
        _memory(row, e)
        shape = {k: getattr(e, k) for k in ("schedule", "stages", "microbatches", "chunks", "bubble_theory")}
    if not rows:
        return None
    out = []
    for rank, row in sorted(rows.items()):
        busy, wall, predicted = row["busy_s"], row["wall_s"], row["predicted_busy_s"]
        idle = 1 - busy / wall if wall > 0 else None
        error = (predicted - busy) / busy if predicted is not None and busy > 0 else None
        memory, predicted_memory = row.get("memory_bytes"), row.get("predicted_memory_bytes")
        memory_error = (predicted_memory - memory) / memory if memory and predicted_memory is not None else None
        out.append(
            {"rank": rank, **row, "idle_share": _round(idle), "prediction_error": _round(error),
             "memory_error": _round(memory_error)}
        )  # fmt: skip
    idles = [r["idle_share"] for r in out if r["idle_share"] is not None]
    return {**shape, "bubble_measured": _round(sum(idles) / len(idles)) if idles else None, "stages_measured": out}


def _memory(row: dict[str, Any], e: ev.PipelineStage) -> None:
    """A report's memory into its rank's row: the largest measured, the last prediction."""
    for key, value in (
        ("state_bytes", e.state_bytes),
        ("activation_bytes", e.activation_bytes),
        ("device_peak_bytes", e.device_peak_bytes),
    ):
        if value is not None:
            row[key] = max(row.get(key) or 0, value)
    state, activations = e.predicted_state_bytes, e.predicted_activation_bytes
    if row.get("activation_bytes") is not None and row.get("state_bytes") is not None:
        row["memory_bytes"] = row["state_bytes"] + row["activation_bytes"]
    if state is not None and activations is not None:
        row.update(predicted_state_bytes=state, predicted_activation_bytes=activations)
        row["predicted_memory_bytes"] = state + activations


def _evals(events: Sequence[Event], attempts: list[tuple[int, bool]], t0: float) -> list[dict[str, Any]]:
    latest: dict[int, dict[str, Any]] = {}
    for e, (attempt, _) in zip(events, attempts, strict=True):
        if isinstance(e, ev.Eval):
            latest[e.step] = {"step": e.step, "loss": e.loss, "attempt": attempt, "t_s": _round(e.t - t0)}
    return [latest[s] for s in sorted(latest)]


@dataclass(slots=True)
class _Marks:
    """Per attempt, in ledger order: injections, progress marks (steps, snapshots), the first
    resume, the drain before a failure; and the failures themselves."""

    injections: dict[int, list[tuple[int, ev.FaultInjected]]] = field(default_factory=dict)
    progress: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    resumes: dict[int, ev.Resume] = field(default_factory=dict)
    drains: dict[int, float] = field(default_factory=dict)  # when Ray Train's shutdown began waiting for rank 0
    failures: list[tuple[int, ev.Failure, int]] = field(default_factory=list)  # (index, event, attempt)
    steps_of: dict[int, list[_Occurrence]] = field(default_factory=dict)

    def failed_at(self, failure: ev.Failure, attempt: int) -> float:
        """The failure event's time, or the start of the drain before it: the failure was decided
        then, and letting rank 0 finish its checkpoint write is part of the recovery."""
        return min(failure.t, self.drains[attempt]) if attempt in self.drains else failure.t


def _marks(events: Sequence[Event], attempts: list[tuple[int, bool]], occurrences: list[_Occurrence]) -> _Marks:
    m = _Marks()
    for i, (e, (attempt, _)) in enumerate(zip(events, attempts, strict=True)):
        if isinstance(e, ev.FaultInjected):
            m.injections.setdefault(attempt, []).append((i, e))
        elif isinstance(e, ev.Step | ev.CheckpointSnapshot):
            m.progress.setdefault(attempt, []).append((i, e.t))
        elif isinstance(e, ev.Resume):
            m.resumes.setdefault(attempt, e)
        elif isinstance(e, ev.CheckpointDrain):
            m.drains[attempt] = e.t - e.waited_s
        elif isinstance(e, ev.Failure):
            m.failures.append((i, e, attempt))
    for o in occurrences:
        m.steps_of.setdefault(o.attempt, []).append(o)
    return m


def _detect_starts(m: _Marks, t0: float) -> list[float | None]:
    """When each fault started to cost time: its injection (else the attempt's last step),
    moved later past any progress made after it and past the previous failure, so that
    no second is counted twice."""
    detect_start: list[float | None] = []
    previous_failure_t = t0
    for i, failure, attempt in m.failures:
        t_fail = m.failed_at(failure, attempt)
        injected = [e for j, e in m.injections.get(attempt, []) if j < i and e.t <= t_fail]
        marks = [t for j, t in m.progress.get(attempt, []) if j < i and t <= t_fail]
        last_step_t = max((o.t for o in m.steps_of.get(attempt, []) if o.index < i), default=None)
        fault_t = injected[-1].t if injected else last_step_t
        if fault_t is None:
            detect_start.append(None)
        else:
            detect_start.append(min(max(fault_t, *marks, previous_failure_t), t_fail))
        previous_failure_t = t_fail
    return detect_start


def _faults(
    events: Sequence[Event],
    attempts: list[tuple[int, bool]],
    occurrences: list[_Occurrence],
    t0: float,
    t_end: float,
) -> list[FaultRecord]:
    """One row per failure event; detection and restart windows never overlap each other or steps."""
    m = _marks(events, attempts, occurrences)
    failures, steps_of, failed_at = m.failures, m.steps_of, m.failed_at
    injections, resumes = m.injections, m.resumes
    known_attempts = sorted({a for a, _ in attempts})
    detect_start = _detect_starts(m, t0)

    rows = []
    for n, (i, failure, attempt) in enumerate(failures):
        t_fail = failed_at(failure, attempt)
        last_reached = max((o.step for o in steps_of.get(attempt, []) if o.index < i), default=None)
        injection = next((e for j, e in reversed(injections.get(attempt, [])) if j < i), None)
        step = injection.step if injection else None
        if step is None:
            step = last_reached
        elif last_reached is None or step > last_reached:
            last_reached = step  # the injecting rank had finished it; others' events may not have arrived
        rank = failure.rank
        if rank is None and injection:
            rank = injection.rank

        next_attempt = next((a for a in known_attempts if a > attempt), None)
        next_steps = steps_of.get(next_attempt, []) if next_attempt is not None else []
        first = next_steps[0] if next_steps else None
        next_failure = next((k for k, (_, _, a) in enumerate(failures) if a == next_attempt), None)
        last_failure_of_attempt = all(a != attempt for _, _, a in failures[n + 1 :])

        # Restart: until the next attempt's first step starts; if it failed before stepping,
        # until its own fault window; if it is still starting, until the last event.
        restart_end = None
        if next_attempt is not None and last_failure_of_attempt:
            if first is not None and (next_failure is None or first.index < failures[next_failure][0]):
                restart_end = first.t - first.step_s
            elif next_failure is not None:
                start = detect_start[next_failure]
                restart_end = start if start is not None else failed_at(failures[next_failure][1], next_attempt)
            else:
                restart_end = t_end
        restart_s = max(restart_end - t_fail, 0.0) if restart_end is not None else 0.0

        resumed_from = None  # the last step whose result the next attempt started from
        resume_step = resumes[next_attempt].step if next_attempt in resumes else None
        if first is not None:
            resumed_from = first.step - 1
        elif resume_step is not None:
            resumed_from = resume_step - 1  # resume.step is the next step to run
        steps_lost = None
        if resumed_from is not None:
            steps_lost = max((last_reached if last_reached is not None else resumed_from) - resumed_from, 0)

        rows.append(
            FaultRecord(
                cause=failure.cause or "unknown",
                rank=rank,
                attempt=attempt,
                step=step,
                t_s=t_fail - t0,
                detected_after_s=None if (began := detect_start[n]) is None else t_fail - began,
                recovered_after_s=(first.t - t_fail) if first is not None else None,
                restart_s=restart_s,
                steps_lost=steps_lost,
                detail=failure.detail,
            )
        )
    return rows


def _startup(events: Sequence[Event], occurrences: list[_Occurrence], faults: list[FaultRecord], t0: float) -> float:
    """Each driver's start-up: its start (run_start, run_continue) to the start of the first step
    after it, less what a failure's restart interval already counts (a driver lost and continued)."""
    begun = sorted((o.t - o.step_s, o.t) for o in occurrences)
    restarts = [(t0 + f.t_s, t0 + f.t_s + f.restart_s) for f in faults]
    total = 0.0
    for e in events:
        if not isinstance(e, ev.RunStart | ev.RunContinue):
            continue
        start = e.t
        first = next((b for b, _ in begun if b >= start), None)
        if first is None:
            continue
        overlap = sum(max(0.0, min(first, hi) - max(start, lo)) for lo, hi in restarts)
        total += max(first - start - overlap, 0.0)
    return total


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def thin(points: list[Any], limit: int) -> list[Any]:
    """At most `limit` evenly spaced points, always keeping the last one."""
    if len(points) <= limit:
        return points
    stride = len(points) / (limit - 1)
    return [points[int(k * stride)] for k in range(limit - 1)] + [points[-1]]
