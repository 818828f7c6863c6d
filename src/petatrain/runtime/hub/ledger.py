"""The run's event ledger as the hub writes it: one writer, events in the order they were sent.

The ledger may live on an object store that cannot be appended to (`observe.ledger.EventLog`
keeps a local copy and uploads it on `flush`), so workers on any node send their events here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from petatrain.observe import events


class EventSink(Protocol):
    """What the ledger writes to (`observe.ledger.EventLog`)."""

    def write(self, record: dict[str, Any]) -> dict[str, Any]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class StepHold:
    """Continuing a run that ended ok: its record changes only once the continuation trains a step.

    Until then its events wait here, and they are dropped if that never comes (`started` stays False).
    """

    def __init__(self, holding: bool = False):
        self._held: list[dict[str, Any]] | None = [] if holding else None

    @property
    def started(self) -> bool:
        """Whether the run's record is being written (nothing held)."""
        return self._held is None

    def admit(self, event: str, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The records to write now: this one, or none while held, or all held once a step comes."""
        if self._held is None:
            return [record]
        self._held.append(record)
        if event != "step":
            return []
        held, self._held = self._held, None  # the continuation started: its record is the run's now
        return held


class Ledger:
    """Writes each event (unless held), then shows it to the `observers` (health, metrics), in order;
    the log is flushed when an event comes more than FLUSH_S after the last flush."""

    FLUSH_S = 5.0

    def __init__(
        self,
        log: EventSink,
        hold: StepHold | None = None,
        observers: Sequence[Callable[[events.Event], None]] = (),
        clock: Callable[[], float] = time.time,
    ):
        self.log, self.hold, self.observers, self.clock = log, hold or StepHold(), tuple(observers), clock
        self.last_flush = clock()

    @property
    def started(self) -> bool:
        return self.hold.started

    def emit(self, event: events.Event) -> dict[str, Any]:
        record = events.line(event)
        for ready in self.hold.admit(event.kind, record):
            self.log.write(ready)
        for observe in self.observers:
            observe(event)
        if self.clock() - self.last_flush > self.FLUSH_S:
            self.flush()
        return record

    def emit_many(self, batch: list[events.Event]) -> None:
        for event in batch:
            self.emit(event)

    def write_at_once(self, event: events.Event) -> None:
        """Written and flushed now, past the observers (an injected fault, before it acts); held like
        any other event while a finished run's continuation has not trained a step (its record stays
        as it was if it never does, and a later driver fires the fault again)."""
        for ready in self.hold.admit(event.kind, events.line(event)):
            self.log.write(ready)
        self.flush()

    def flush(self) -> None:
        self.log.flush()
        self.last_flush = self.clock()

    def close(self) -> None:
        self.log.close()
