"""Why an attempt failed, as types.

A failed attempt reaches the supervisor as an `AttemptFailed`: one `RankError` per rank that
failed, each plain data that survives pickling (Ray Train's own error types stay in
`runtime/_ray`, which converts them). `classify` turns it, with the watchdog's verdict and
what the cluster lost, into a `Failure` whose `FailureCause` the ledger records and the
restart policy decides on.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from petatrain.errors import PetatrainError
from petatrain.train.rank import Preempted, Resized


class FailureCause(enum.StrEnum):
    """What ended an attempt; the value is what the ledger's `failure` event records."""

    KILL = "kill"  # a rank's process died (SIGKILL, OOM killer, crash)
    EXCEPTION = "exception"  # a rank raised
    HANG = "hang"  # no step progress within faults.hang_timeout_s (the watchdog)
    NODE_LOST = "node_lost"  # a node of the cluster died during the attempt
    DRIVER_LOST = "driver_lost"  # the driver stopped mid-run (head pod lost, RayJob retry); a new one continues
    PREEMPT = "preempt"  # a preemption notice, after the checkpoint of the current step
    RESIZE = "resize"  # the cluster grew back: more workers, after the checkpoint of the current step
    NONFINITE = "nonfinite"  # a NaN/inf loss with faults.nonfinite=rollback
    ERROR = "error"  # a petatrain error (bad config, missing or corrupt data): a retry fails the same way
    UNKNOWN = "unknown"


class RankErrorKind(enum.StrEnum):
    RAISED = "raised"  # the training function raised
    DIED = "died"  # the rank's process is gone (Ray's health check failed, its actor died)
    UNRESPONSIVE = "unresponsive"  # Ray's health check of the rank timed out
    OTHER = "other"  # not a rank's error: the controller's, or the worker group never started


@dataclass(frozen=True, slots=True)
class RankError:
    """One rank's error as the driver learns it: plain data, so it pickles across processes."""

    rank: int | None
    kind: RankErrorKind
    type_name: str  # the exception's qualified name, as a traceback prints it
    message: str
    cause: FailureCause | None = None  # what the exception's type says, where it says something

    @property
    def first_line(self) -> str:
        return next((line for line in self.message.splitlines() if line.strip()), "")

    @property
    def summary(self) -> str:
        """`Type: first line of the message`, as a traceback's last line reads."""
        return f"{self.type_name}: {self.first_line}"[:300] if self.first_line else self.type_name[:300]


@dataclass(eq=False)
class AttemptFailed(Exception):
    """A failed attempt: every failing rank's error (ranks in order) and the text Ray gave."""

    errors: list[RankError]
    text: str = ""

    def __post_init__(self) -> None:
        Exception.__init__(self, self.text or "; ".join(e.summary for e in self.errors))

    def __reduce__(self):
        return (AttemptFailed, (self.errors, self.text))


@dataclass(slots=True)
class Failure:
    """A classified failure: what the ledger records and the restart policy decides on."""

    cause: FailureCause
    detail: str
    rank: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"cause": self.cause.value, "detail": self.detail, "rank": self.rank}


Causes = Mapping[type[BaseException], FailureCause]
# Exception types that name their cause; the run adds its own (the loop's NonFiniteLoss).
CAUSES: dict[type[BaseException], FailureCause] = {Preempted: FailureCause.PREEMPT, Resized: FailureCause.RESIZE}


def cause_of(exc: BaseException, causes: Causes | None = None) -> FailureCause | None:
    """The cause an exception's type names: a registered type, or any petatrain error (not retried)."""
    for kind, cause in (causes or CAUSES).items():
        if isinstance(exc, kind):
            return cause
    return FailureCause.ERROR if isinstance(exc, PetatrainError) else None


def rank_error(
    rank: int | None,
    exc: BaseException,
    kind: RankErrorKind = RankErrorKind.RAISED,
    causes: Causes | None = None,
) -> RankError:
    """A RankError from an exception (qualified as a traceback prints it: builtins unqualified)."""
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    cause = cause_of(exc, causes) if kind is RankErrorKind.RAISED else None
    return RankError(rank, kind, name, str(exc), cause)


# What a surviving rank raises when a peer's process is gone in the middle of a collective.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def lost_a_peer(error: AttemptFailed) -> bool:
    """Whether a rank's error is a collective that lost its peer (the peer's death may be the cause)."""
    return any(any(marker in e.message for marker in PEER_LOST) for e in error.errors)


def classify(error: AttemptFailed, *, hang: Failure | None, nodes_lost: bool, died: int | None = None) -> Failure:
    """The cause of a failed attempt, from the watchdog's verdict and the ranks' errors.

    `died`: the rank whose process Ray saw die on its own during the attempt, when the
    ranks' errors name only those that survived it (their collective failed first).
    """
    if hang is not None:
        return hang
    errors = error.errors
    first = next((e for e in errors if e.kind is RankErrorKind.RAISED), errors[0] if errors else None)
    detail = first.summary if first else str(error)[:300]
    rank = first.rank if first else None

    def by(cause: FailureCause) -> RankError | None:
        return next((e for e in errors if e.cause is cause), None)

    for cause in (FailureCause.PREEMPT, FailureCause.RESIZE, FailureCause.NONFINITE):
        named = by(cause)
        if named is not None:
            return Failure(cause, named.summary, named.rank)
    if nodes_lost:
        return Failure(FailureCause.NODE_LOST, detail, rank)
    dead = next((e for e in errors if e.kind is RankErrorKind.DIED), None)
    if dead is not None:
        return Failure(FailureCause.KILL, f"worker process died: {dead.first_line or dead.summary}"[:300], dead.rank)
    if died is not None:
        return Failure(FailureCause.KILL, f"worker process of rank {died} died: {detail}", died)
    named = by(FailureCause.ERROR)
    if named is not None:
        return Failure(FailureCause.ERROR, named.summary, named.rank)
    if first is not None and first.kind is RankErrorKind.RAISED:
        return Failure(FailureCause.EXCEPTION, detail, rank)
    return Failure(FailureCause.UNKNOWN, detail, rank)
