"""The event kinds of a run's ledger (`RUN/events.jsonl`), one dataclass each: the schema.

Every event is written as its class (its emitter builds it: a field the class does not have, or
one it needs and is not given, is a bug that mypy and the constructor catch), turned into its
ledger line by `line` (`record(kind, fields)` builds the class from a kind's name), and read back
through `parse` (one line, strictly) or `read` (a whole ledger, as its readers take it).
A line carries `t` (unix seconds, from the process that saw it), `event` (the kind) and `v`
(`SCHEMA_VERSION`; ledgers written before the version have none and read as version 1). A reader
of a ledger written by a newer petatrain refuses it.

The readers (`goodput.py`, the report, the Prometheus metrics, the console, lineage, MLflow,
a search's trials) take the classes, never the raw lines.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = 1


@dataclass(kw_only=True, slots=True, frozen=True)
class Event:
    kind: ClassVar[str] = ""
    t: float = field(default_factory=time.time)  # when it happened, by the clock of the process that saw it


@dataclass(kw_only=True, slots=True, frozen=True)
class RunStart(Event):
    kind: ClassVar[str] = "run_start"
    run_id: str
    workers: list[int]  # [min, max]
    steps: int
    config: dict[str, Any]  # the resolved config, credentials left out
    metrics: str = ""  # the Prometheus endpoint, "" when off
    health: str = ""  # the driver's health endpoint (/livez, /readyz), "" when off
    source: dict[str, Any] | None = None  # a branch: {"from": RUN@STEP or "trial ID", "step": S}


@dataclass(kw_only=True, slots=True, frozen=True)
class RunContinue(Event):
    """A new driver (`train --resume`: a RayJob retry, a lost head pod, a new cluster) continues the run."""

    kind: ClassVar[str] = "run_continue"
    run_id: str
    attempt: int  # the attempt the new driver starts with
    previous: str  # how the previous driver ended: interrupted (no end event) | ok | failed
    steps: int  # the config's train.steps for this driver (a run may be extended)
    metrics: str = ""
    health: str = ""
    # A branch: the run goes on from another run's (a better trial's) checkpoint, {"from", "step"},
    # with `config` (its hyperparameters mutated); what the previous driver was doing is abandoned.
    source: dict[str, Any] | None = None
    config: dict[str, Any] | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class AttemptStart(Event):
    kind: ClassVar[str] = "attempt_start"
    attempt: int
    world_size: int
    controller: str = "driver"  # where Ray Train's control loop runs: driver | actor
    warm_controller: bool = False  # an actor controller started while the previous attempt trained


@dataclass(kw_only=True, slots=True, frozen=True)
class WorkerStart(Event):
    kind: ClassVar[str] = "worker_start"
    attempt: int
    rank: int
    pid: int
    node: str
    warm_up: dict[str, Any] | None = None  # a spare's warm-up (started, ready, idle, CPU s); None if none
    torch_threads: int | None = None
    placement_group: str = ""  # the attempt's Ray placement group (removed if its driver died)


@dataclass(kw_only=True, slots=True, frozen=True)
class Resume(Event):
    kind: ClassVar[str] = "resume"
    attempt: int
    step: int  # the next step to run
    checkpoint: str | None  # URL of the checkpoint loaded, None for a fresh start


@dataclass(kw_only=True, slots=True, frozen=True)
class Step(Event):
    """One training step, from rank 0."""

    kind: ClassVar[str] = "step"
    attempt: int
    step: int
    step_s: float  # end of the previous step to the end of this one: data wait in, checkpoint stall out
    data_wait_s: float
    loss: float | None  # None when the loss was not finite
    lr: float | None = None
    tokens: int = 0
    grad_norm: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointSnapshot(Event):
    """What the loop paid to take a checkpoint; with `checkpoint.asynchronous: false` the whole
    write, and the event comes after the commit's."""

    kind: ClassVar[str] = "checkpoint_snapshot"
    attempt: int
    step: int
    stall_s: float
    live: bool = False  # written from the training state itself, not a copy


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointStaging(Event):
    """A later step waited for the write of a live snapshot to read its tensors (stall too)."""

    kind: ClassVar[str] = "checkpoint_staging"
    attempt: int
    step: int
    wait_s: float


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointCommit(Event):
    kind: ClassVar[str] = "checkpoint_commit"
    attempt: int
    step: int
    write_s: float
    bytes: int
    url: str


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointSkipped(Event):
    """A checkpoint passed over at resume: torn, corrupt, or its record does not check out."""

    kind: ClassVar[str] = "checkpoint_skipped"
    url: str
    reason: str
    attempt: int | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointDrain(Event):
    """A failed attempt's rank 0 let finish its checkpoint write before Ray Train kills it; the
    report counts the wait as restart, not detection."""

    kind: ClassVar[str] = "checkpoint_drain"
    attempt: int
    lost: list[int]  # ranks gone
    waited_s: float
    done: bool | None  # rank 0 has no write in flight; None if rank 0 is gone
    committed: int | None  # newest step rank 0 committed


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineStage(Event):
    """One pipeline rank's compute over a window of steps (sent at each checkpoint and at the end):
    `busy_s` the time in its stages' forward and backward, `wall_s` the schedule steps' whole time,
    `predicted_busy_s` what the partition's per-unit costs predict (None without a layer profile)."""

    kind: ClassVar[str] = "pipeline_stage"
    attempt: int
    rank: int
    parts: list[int]
    units: list[str]  # first and last unit of each part: "first", "block.3", "last"
    steps: int
    busy_s: float
    wall_s: float
    schedule: str
    stages: int
    microbatches: int
    chunks: int
    bubble_theory: float = 0.0  # (P-1)/(v M + P-1): the idle share of a step the schedule implies
    predicted_busy_s: float | None = None
    param_bytes: int = 0  # of the parameters this rank holds
    state_bytes: int = 0  # its weights, gradients and optimizer state (its shards under data fsdp)
    activation_bytes: int | None = None  # the most bytes autograd held for backward at once (a step counted)
    device_peak_bytes: int | None = None  # the accelerator allocator's peak over the window (CUDA)
    predicted_state_bytes: int | None = None  # from the layer profile's parameter bytes
    predicted_activation_bytes: int | None = None  # the profile's saved bytes, in flight as the schedule runs
    warm_up: bool = False  # the attempt's first window: its first steps set up the schedule (left out of the table)
    # The data-parallel dimension's share: the gradients averaged over the stage's replicas (and the copies
    # of a tied weight summed) after each schedule step, outside `wall_s`. None in ledgers from before it.
    reduce_s: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Eval(Event):
    kind: ClassVar[str] = "eval"
    attempt: int
    step: int
    loss: float


@dataclass(kw_only=True, slots=True, frozen=True)
class NonFinite(Event):
    kind: ClassVar[str] = "nonfinite"
    attempt: int
    step: int
    action: str  # skip | rollback


@dataclass(kw_only=True, slots=True, frozen=True)
class FaultInjected(Event):
    """Written by the chaos injector before the fault acts."""

    kind: ClassVar[str] = "fault_injected"
    attempt: int
    fault: str
    step: int | None = None
    rank: int | None = None
    key: str = ""


@dataclass(kw_only=True, slots=True, frozen=True)
class Failure(Event):
    kind: ClassVar[str] = "failure"
    attempt: int
    cause: str  # kill | exception | hang | node_lost | driver_lost | preempt | resize | nonfinite | error | unknown
    detail: str
    rank: int | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Restart(Event):
    kind: ClassVar[str] = "restart"
    attempt: int  # the new one
    reason: str  # the failure's cause
    world_size: int | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class End(Event):
    kind: ClassVar[str] = "end"
    status: str  # ok | failed | stopped (a search's scheduler stopped the trial)
    step: int | None
    detail: str = ""
    final: str | None = None  # URL of the final weights


@dataclass(kw_only=True, slots=True, frozen=True)
class Mlflow(Event):
    """The run's mirror in MLflow (observe/mlflow.py): logged, or pending with why (`petatrain mlflow
    sync RUN` logs it later)."""

    kind: ClassVar[str] = "mlflow"
    status: str  # logged | pending
    uri: str  # the tracking server
    mlflow_run_id: str = ""
    detail: str = ""


@dataclass(kw_only=True, slots=True, frozen=True)
class Unreadable(Event):
    """A ledger line with a time that is no event of this schema: a kind this petatrain does not
    know, or a field missing or of the wrong type. Made by `read`, never written: it says the run
    was alive at `t`, and nothing else."""

    kind: ClassVar[str] = "unreadable"
    event: str  # the line's kind, as written
    reason: str


KINDS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStart,
        RunContinue,
        AttemptStart,
        WorkerStart,
        Resume,
        Step,
        CheckpointSnapshot,
        CheckpointStaging,
        CheckpointCommit,
        CheckpointSkipped,
        CheckpointDrain,
        Eval,
        PipelineStage,
        NonFinite,
        FaultInjected,
        Failure,
        Restart,
        End,
        Mlflow,
    )
}


def line(event: Event) -> dict[str, Any]:
    """The ledger line of an event."""
    return {"t": event.t, "event": event.kind, "v": SCHEMA_VERSION} | {
        f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name != "t"
    }


def record(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The ledger line for an event of `kind` with `fields`, checked against its class."""
    cls = KINDS.get(kind)
    if cls is None:
        raise TypeError(f"no event kind {kind!r}; add a class to petatrain.observe.events")
    fields = dict(fields)
    t = fields.pop("t", None) or time.time()
    return line(cls(t=t, **fields))  # TypeError names a field that is wrong


def parse(line: dict[str, Any]) -> Event:
    """The typed event of one ledger line, strictly: ValueError for a line `read` would not take
    as an event (no time, a kind or version this petatrain cannot read, a field that does not fit)."""
    found = read([line])
    if not found:
        raise ValueError("not an event of this petatrain: no time")
    if isinstance(found[0], Unreadable):
        raise ValueError(f"not an event of this petatrain: {found[0].event} event: {found[0].reason}")
    return found[0]


def read(lines: Iterable[Any]) -> list[Event]:
    """The typed events of a ledger's lines, in order, as a report reads a run that crashed,
    is in progress or was written by hand: a line without a time is left out; one whose kind
    is unknown, or whose field is missing or of the wrong type, becomes `Unreadable` (a field
    that has a default takes it instead, and one that may be None is None). A number is taken
    for a float field and a whole float for an int one; NaN is no number. A newer schema
    version raises ValueError."""
    out: list[Event] = []
    for line in lines:
        if not isinstance(line, dict):
            continue
        t = _number(line.get("t"))
        if t is None:
            continue
        version = line.get("v", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(f"event schema version {version!r}; this petatrain reads up to {SCHEMA_VERSION}")
        kind = str(line.get("event"))
        cls = KINDS.get(kind)
        if cls is None:
            out.append(Unreadable(t=t, event=kind, reason="unknown kind"))
            continue
        fields: dict[str, Any] = {"t": t}
        for name, (check, default) in _readers(cls).items():
            value = check(line.get(name, _MISSING))
            if value is _MISSING:
                value = default
            if value is _MISSING:
                break
            fields[name] = value
        else:
            out.append(cls(**fields))
            continue
        out.append(Unreadable(t=t, event=kind, reason=f"{name}: {line.get(name, 'missing')!r}"))
    return out


def as_events(items: Iterable[Event | dict[str, Any]]) -> list[Event]:
    """Events as their classes, in order: a ledger line among them is read through `read`."""
    return [e for item in items for e in ([item] if isinstance(item, Event) else read([item]))]


def attempt_of(event: Event) -> int | None:
    """The attempt an event names, if its kind has one."""
    attempt = getattr(event, "attempt", None)
    return attempt if isinstance(attempt, int) else None


_MISSING: Any = object()
_READERS: dict[type[Event], dict[str, tuple[Callable[[Any], Any], Any]]] = {}


def _readers(cls: type[Event]) -> dict[str, tuple[Callable[[Any], Any], Any]]:
    """Per field but `t`: what checks a value (returns it, converted, or _MISSING) and its default."""
    if cls not in _READERS:
        table = {}
        for f in dataclasses.fields(cls):
            if f.name == "t":
                continue
            default = f.default if f.default is not dataclasses.MISSING else _MISSING
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            table[f.name] = (_check(str(f.type)), default)
        _READERS[cls] = table
    return _READERS[cls]


def _check(annotation: str) -> Callable[[Any], Any]:
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None").split("[")[0]
    convert: Callable[[Any], Any] = {
        "float": _number,
        "int": _whole,
        "str": lambda v: v if isinstance(v, str) else None,
        "bool": lambda v: v if isinstance(v, bool) else None,
        "list": lambda v: v if isinstance(v, list) else None,
        "dict": lambda v: v if isinstance(v, dict) else None,
    }.get(base, lambda v: v)

    def check(value: Any) -> Any:
        if value is _MISSING or value is None:
            return None if optional else _MISSING
        converted = convert(value)
        if converted is None:
            return None if optional else _MISSING
        return converted

    return check


def _number(value: Any) -> float | None:
    if type(value) is int:  # not isinstance: a bool is not a number here
        return float(value)
    return value if type(value) is float and not math.isnan(value) else None


def _whole(value: Any) -> int | None:
    if type(value) is int:
        return value
    return int(value) if type(value) is float and value.is_integer() else None
