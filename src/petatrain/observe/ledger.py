"""The run's append-only event ledger, `RUN/events.jsonl`: one JSON object per line.

The event kinds and their fields are the classes of `petatrain.observe.events`; every line
is written through them. A local ledger is appended line by line; a ledger on an object
store is kept in a local file and uploaded whole on `flush()` (objects cannot be appended
to). A reader skips a torn last line.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petatrain.errors import PetatrainError
from petatrain.observe import events
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, exists, is_local, read_bytes, refuse_links, resolve

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Writes events to `RUN/events.jsonl`; safe to call from several threads."""

    def __init__(self, run_url: str, options: StorageOptions | None = None):
        self.url = join(run_url, EVENTS_FILE)
        self.options = options or StorageOptions()
        self._lock = threading.Lock()
        if is_local(self.url):
            _, path = resolve(self.url, self.options)
            refuse_links(path, itself=True)  # appending follows a link: another file would take the lines
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._path = Path(path)
            self._remote = False
        else:
            fd, name = tempfile.mkstemp(prefix="petatrain-events-", suffix=".jsonl")
            os.close(fd)
            self._path = Path(name)
            if exists(self.url, self.options):  # a resumed run keeps its history
                self._path.write_bytes(read_bytes(self.url, self.options))
            self._remote = True
        self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """An event given by its kind's name and fields (`write_event` takes the class itself)."""
        return self.write(self.record(event, **fields))

    def write_event(self, event: events.Event) -> dict[str, Any]:
        return self.write(events.line(event))

    @staticmethod
    def record(event: str, **fields: Any) -> dict[str, Any]:
        """The event as the ledger holds it (checked against its schema), not yet written."""
        try:
            return events.record(event, fields)
        except TypeError as exc:  # a bug in an emitter: keep the event (a lost step or heartbeat is worse)
            log.error("event %s does not fit its schema: %s", event, exc)
            return {"t": fields.pop("t", None) or time.time(), "event": event, "schema_error": str(exc), **fields}

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
        return record

    def flush(self) -> None:
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            if self._remote:
                atomic_write(self.url, self._path.read_bytes(), self.options)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._file.close()
        if self._remote:
            self._path.unlink(missing_ok=True)


def read_events(run_url: str, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """All events of a run, in file order; a torn last line is skipped."""
    text = read_bytes(join(run_url, EVENTS_FILE), options).decode("utf-8", errors="replace")
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


class LedgerFollower:
    """Reads the run's `events.jsonl` as it grows (a thread) and hands each new event, as its
    class (`events.read`), to `on_event`, from this driver's `run_start` (or `run_continue`) on: what was in the ledger
    before (an earlier driver of the run) is skipped, and so is what a driver that still holds the folder writes before
    this one is refused.

    A local ledger is read from where the last read ended, every half second. One on an object
    store is uploaded whole by the hub every few seconds, so it is read whole as often."""

    def __init__(self, run_url: str, options: StorageOptions | None, on_event: Callable[[events.Event], None]):
        self.run_url, self.options, self.on_event = run_url, options, on_event
        self._path = resolve(join(run_url, EVENTS_FILE), options)[1] if is_local(run_url) else None
        self.every_s = 0.5 if self._path else 5.0
        self._offset = os.path.getsize(self._path) if self._path and os.path.exists(self._path) else 0
        self._seen = 0 if self._path else len(self._remote_events())
        self._started = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="petatrain-ledger-follower", daemon=True)
        self._thread.start()

    def _remote_events(self) -> list[dict[str, Any]]:
        try:
            return read_events(self.run_url, self.options)
        except (FileNotFoundError, OSError):
            return []

    def _new_events(self) -> list[dict[str, Any]]:
        if self._path is None:
            events = self._remote_events()
            fresh, self._seen = events[self._seen :], max(self._seen, len(events))
            return fresh
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        fresh = []
        for line in complete.splitlines():
            try:
                fresh.append(json.loads(line))
            except ValueError:
                continue
        return fresh

    def _poll(self) -> None:
        try:
            for event in events.read(self._new_events()):
                self._started = self._started or isinstance(event, events.RunStart | events.RunContinue)
                if self._started:
                    self.on_event(event)
        except Exception:  # progress is best effort; the run's outcome does not depend on it
            log.debug("ledger follower", exc_info=True)

    def _follow(self) -> None:
        while not self._done.wait(self.every_s):
            self._poll()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._poll()  # the events written since the last poll, the run's end among them


@dataclass(frozen=True, slots=True)
class PriorRun:
    """What a run's ledger says about it: how a continuing driver (`train --resume`) takes it over, its
    lineage (observe.lineage)."""

    run_id: str
    config: dict[str, Any]  # the config the run started with, or a branch's since (run_start, run_continue)
    next_attempt: int  # the attempt number a continuing driver starts with
    step: int  # the step the run last reached
    ended: str  # "" when the last driver stopped without an end event; else the end's status (ok | failed)
    fired: list[str]  # injected faults that fired already (none fires again)
    failures: list[events.Failure]  # the failure events so far
    placement_groups: list[str]  # of its attempts (worker_start events): a dead driver's stay reserved
    # A run started by `train --continue`: the step of the checkpoint it continued from, whose loader
    # position each recovery carries onto the run's dataset version again (until a checkpoint of its own).
    carry_step: int | None = None
    source: dict[str, Any] | None = None  # run_start's: the checkpoint a --from or --continue started from

    def describe(self) -> str:
        how = {"": "interrupted", "ok": "finished", "failed": "failed"}.get(self.ended, self.ended)
        return f"run {self.run_id} ({how} at step {self.step}, {self.next_attempt} attempt(s))"


def typed_events(run_url: str, options: StorageOptions | None = None) -> list[events.Event]:
    """All events of a run as their classes (`events.read`: a torn or foreign line only marks
    its time); a ledger written by a newer petatrain is an error."""
    try:
        return events.read(read_events(run_url, options))
    except ValueError as exc:
        raise PetatrainError(f"{join(run_url, EVENTS_FILE)}: {exc}") from None


def load_events(run_url: str, options: StorageOptions | None = None) -> list[events.Event]:
    """The run's events as their classes; a missing run, ledger or an empty ledger is an error saying which."""
    ledger = join(run_url, EVENTS_FILE)
    if not exists(ledger, options):
        if not exists(run_url, options):
            raise PetatrainError(f"run not found: {run_url}")
        raise PetatrainError(f"{run_url} has no {EVENTS_FILE}: not a petatrain run, or it has not started")
    found = typed_events(run_url, options)
    if not found:
        raise PetatrainError(f"{ledger} holds no readable events")
    return found


def prior_run_from(typed: Sequence[events.Event]) -> PriorRun | None:
    """The run a ledger's events hold; None when it never started."""
    start = next((e for e in typed if isinstance(e, events.RunStart)), None)
    if start is None:
        return None
    attempts = [a for e in typed if (a := events.attempt_of(e)) is not None]
    steps = [e.step for e in typed if isinstance(e, events.Step)]
    end: events.End | None = None
    config = start.config
    for e in typed:
        if isinstance(e, events.End):
            end = e
        elif isinstance(e, events.RunContinue | events.AttemptStart):
            end = None  # an end before a later driver's start belongs to an earlier driver
        if isinstance(e, events.RunContinue) and e.config is not None:
            config = e.config  # a branch went on with other hyperparameters
    return PriorRun(
        run_id=start.run_id,
        config=config,
        next_attempt=max(attempts, default=-1) + 1,
        step=steps[-1] if steps else 0,  # a branch may have gone back to an earlier step
        ended=(end.status or "failed") if end else "",
        fired=sorted({e.key for e in typed if isinstance(e, events.FaultInjected) and e.key}),
        failures=[e for e in typed if isinstance(e, events.Failure)],
        placement_groups=sorted(
            {e.placement_group for e in typed if isinstance(e, events.WorkerStart) and e.placement_group}
        ),
        carry_step=_carry_step(start.source),
        source=start.source,
    )


def _carry_step(source: Any) -> int | None:
    if isinstance(source, dict) and source.get("carry") and isinstance(source.get("step"), int):
        return int(source["step"])
    return None
