"""The run's append-only event ledger, `RUN/events.jsonl`: one JSON object per line.

Every event has `t` (unix seconds, from the process that saw it) and `event` (its kind).
The kinds and their fields, which `goodput.py` and the report read:

    run_start         run_id, workers ([min, max]), steps, config (the resolved config)
    attempt_start     attempt, world_size
    worker_start      attempt, rank, pid, node
    resume            attempt, step (next step to run), checkpoint (URL or null)
    step              attempt, step, step_s (end of previous step to end of this one, data
                      wait included, checkpoint stall excluded), data_wait_s, loss, lr,
                      tokens, grad_norm
    checkpoint_snapshot  attempt, step, stall_s (what the training loop paid), live (written
                         from the training state itself, not a copy); with
                         checkpoint.asynchronous false the stall is the whole write and
                         the event comes after the commit's
    checkpoint_staging   attempt, step, wait_s (a later step waited this long for the write of
                         a live snapshot to read its tensors before optimizer.step; stall too)
    checkpoint_commit    attempt, step, write_s, bytes, url
    checkpoint_skipped   url, reason (torn or corrupt, at resume)
    checkpoint_drain     attempt, lost (ranks gone), waited_s, done (rank 0 has no write in
                         flight; null if rank 0 is gone), committed (newest step rank 0
                         committed, or null): a failed attempt's rank 0 let finish its
                         checkpoint write before Ray Train kills it; the report counts the
                         wait as restart, not detection
    eval              attempt, step, loss
    nonfinite         attempt, step, action (skip | rollback)
    fault_injected    attempt, fault, step, rank (written by the chaos injector)
    failure           attempt, cause (kill | exception | hang | node_lost | preempt | storage |
                      nonfinite | unknown), detail, rank
    restart           attempt (the new one), world_size, reason
    end               status (ok | failed), step, detail, final (URL of the final weights)

A local ledger is appended line by line; a ledger on an object store is kept in a local
file and uploaded whole on `flush()` (objects cannot be appended to). A reader skips a
torn last line.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, exists, is_local, read_bytes, resolve

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Writes events to `RUN/events.jsonl`; safe to call from several threads."""

    def __init__(self, run_url: str, options: StorageOptions | None = None):
        self.url = join(run_url, EVENTS_FILE)
        self.options = options or StorageOptions()
        self._lock = threading.Lock()
        if is_local(self.url):
            _, path = resolve(self.url, self.options)
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
        record = {"t": fields.pop("t", None) or time.time(), "event": event, **fields}
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
