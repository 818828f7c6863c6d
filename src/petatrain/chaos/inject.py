"""Fault injection specs: `KIND@step=N[,rank=R][,count=C]` or `KIND@t=SECONDS[,rank=R]`.

Kinds, one per fault the training loop must survive:
    kill       SIGKILL the worker process (a machine fault)
    raise      raise an exception in the training loop (a runtime exception)
    hang       SIGSTOP the worker (a hang; found by the watchdog, not the collective timeout)
    partition  cut the network link of the worker's node (needs the network-namespace harness)
    preempt    SIGTERM the worker (a preemption notice: checkpoint at the step boundary, exit)
    storage    the next `count` checkpoint writes of the rank fail with a transient error
    nan        the rank's loss becomes NaN at that step

Each injection fires once per run: the run hub records it, and a resumed attempt does not
fire it again. A step spec fires at the boundary after step N; a time spec at the first
step boundary at least SECONDS after the run started. The training loop fires them through
`RankFaults.at_step`.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from petatrain.errors import ConfigError

log = logging.getLogger(__name__)

KINDS = ("kill", "raise", "hang", "partition", "preempt", "storage", "nan")


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str
    step: int | None = None
    at_s: float | None = None
    rank: int = 0
    count: int = 3

    @property
    def key(self) -> str:
        when = f"step={self.step}" if self.step is not None else f"t={self.at_s:g}"
        return f"{self.kind}@{when},rank={self.rank}"

    def due(self, step: int, elapsed_s: float) -> bool:
        if self.step is not None:
            return step == self.step
        return self.at_s is not None and elapsed_s >= self.at_s


def parse(spec: str) -> Injection:
    """'kill@step=17,rank=1' -> Injection; errors name the part that is wrong."""
    kind, sep, rest = spec.strip().partition("@")
    if kind not in KINDS:
        raise ConfigError(f"--inject {spec!r}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
    if not sep:
        raise ConfigError(f"--inject {spec!r}: say when, e.g. {kind}@step=10 or {kind}@t=30")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("step", "t", "rank", "count"):
            raise ConfigError(f"--inject {spec!r}: cannot read {part!r} (use step=N, t=SECONDS, rank=R, count=C)")
        if key.strip() in fields:  # the last one winning silently hid a typo
            raise ConfigError(f"--inject {spec!r}: {key.strip()} is given twice")
        fields[key.strip()] = value.strip()
    try:
        step = int(fields["step"]) if "step" in fields else None
        at_s = float(fields["t"].rstrip("s")) if "t" in fields else None
        rank = int(fields.get("rank", 0))
        count = int(fields.get("count", 3))
    except ValueError:
        raise ConfigError(f"--inject {spec!r}: step, rank and count are integers, t is seconds") from None
    if (step is None) == (at_s is None):
        raise ConfigError(f"--inject {spec!r}: give exactly one of step=N or t=SECONDS")
    if (step is not None and step < 1) or rank < 0 or count < 1:
        raise ConfigError(f"--inject {spec!r}: step and count must be >= 1 and rank >= 0")
    if at_s is not None and not 0 <= at_s < float("inf"):  # -5 and nan fired at step 1
        raise ConfigError(f"--inject {spec!r}: t must be a number of seconds >= 0")
    return Injection(kind=kind, step=step, at_s=at_s, rank=rank, count=count)


class InjectedFault(RuntimeError):
    """The exception the `raise` injector throws."""


def act(injection: Injection) -> None:
    """Do what the injection says to this process (kinds handled in the loop excluded)."""
    if injection.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif injection.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif injection.kind == "preempt":
        os.kill(os.getpid(), signal.SIGTERM)
    elif injection.kind == "raise":
        raise InjectedFault(f"injected exception ({injection.key})")
    elif injection.kind == "partition":
        from petatrain.chaos.netns import cut_own_link

        cut_own_link()


class RankFaults:
    """The injections one rank fires, at step boundaries; the training loop calls `at_step` once a step.

    `claim(key, fields)` records the fault in the run's ledger and says whether it is still to
    fire (each fires once per run, whichever attempt gets there first); `arm_storage(count)`
    makes the next `count` checkpoint writes fail; `await_notice()` waits until this
    process's own SIGTERM handler has run (a `preempt` is noticed at the boundary it was sent).
    Injections for other ranks are watched too, so the ledger holds every step up to them.
    """

    def __init__(
        self,
        injections: list[Injection],
        *,
        rank: int,
        fired: set[str],
        claim: Callable[[str, dict], bool],
        arm_storage: Callable[[int], None],
        await_notice: Callable[[], object],
        before_firing: Callable[[], None] = lambda: None,
    ):
        live = [i for i in injections if i.key not in fired]  # an earlier attempt fired the others
        self.mine = [i for i in live if i.rank == rank]
        self.others = [i for i in live if i.rank != rank]
        self.rank = rank
        self._claim, self._arm_storage, self._await_notice = claim, arm_storage, await_notice
        self._before_firing = before_firing
        self.poison_next = False  # a `nan` fired: the next step's loss is NaN

    def imminent_elsewhere(self, step: int, elapsed_s: float, margin_s: float) -> bool:
        """Another rank's fault fires within `margin_s`: its steps must reach the ledger at once."""
        if not any(i.due(step, elapsed_s + margin_s) for i in self.others):
            return False
        self.others = [i for i in self.others if not _passed(i, step, elapsed_s, margin_s)]
        return True

    def at_step(self, step: int, elapsed_s: float) -> None:
        """Fire this rank's injections due at the boundary after `step`."""
        for injection in [i for i in self.mine if i.due(step, elapsed_s)]:
            self.mine.remove(injection)
            self._before_firing()  # the steps before the fault are in the ledger before it
            if injection.kind == "partition" and not _partitionable():
                log.warning("%s: rank %d is not on a node the harness can cut; not fired", injection.key, self.rank)
                continue
            fields = {"fault": injection.kind, "step": step, "rank": self.rank, "key": injection.key}
            if not self._claim(injection.key, fields):
                continue
            if injection.kind == "storage":
                self._arm_storage(injection.count)
            elif injection.kind == "nan":
                self.poison_next = True
            else:
                act(injection)
                if injection.kind == "preempt":
                    self._await_notice()


def _passed(injection: Injection, step: int, elapsed_s: float, margin_s: float) -> bool:
    if injection.step is not None:
        return step >= injection.step
    return injection.at_s is not None and elapsed_s >= injection.at_s + margin_s


def _partitionable() -> bool:
    from petatrain.chaos.netns import on_cuttable_node

    return on_cuttable_node()
