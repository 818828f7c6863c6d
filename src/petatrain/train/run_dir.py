"""The run directory: train writes only into a run of its own, or into a new or empty folder,
and one driver at a time.

A run carries `RUN/.petatrain-run` (JSON: format "petatrain-run", version, created), written
when train first claims the folder; a run made before the marker has an `events.jsonl` with
a `run_start` event. Any other non-empty folder is someone else's: train refuses it rather
than overwrite its config.yaml, final/ or report.html, or let retention prune its checkpoints/.
For the run's duration the driver holds a lease on `RUN/_lock` (`petatrain.storage.lock`):
a second driver on the same run fails at once instead of interleaving its checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

from petatrain.errors import PetatrainError
from petatrain.observe.ledger import EVENTS_FILE
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, resolve
from petatrain.storage.lock import Lease
from petatrain.storage.retry import retrying

MARKER = ".petatrain-run"
FORMAT = "petatrain-run"
VERSION = 1
LOCK = "_lock"


@contextlib.contextmanager
def held(run_url: str, options: StorageOptions | None = None) -> Iterator[Lease]:
    """Claim `run_url` (`claim`) and hold its lease until the block ends; `LeaseHeld` (one line:
    host, pid, since when) while another live driver holds it."""
    claim(run_url, options)  # the marker comes first: a folder holding only a lease is not a run
    with Lease(join(run_url, LOCK), kind="train", what=f"--run-dir {run_url}", options=options) as lease:
        yield lease


def claim(run_url: str, options: StorageOptions | None = None) -> None:
    """Make `run_url` a petatrain run (new, empty, or one already): write its marker; a file or
    a non-empty folder that is not a run is refused with a one-line PetatrainError."""
    fs, path = resolve(run_url, options)
    fs.invalidate_cache(path)
    if retrying(f"stat {run_url}", lambda: fs.isfile(path)):
        raise PetatrainError(f"--run-dir {run_url} is a file, not a folder")
    marker = _read(run_url, MARKER, options)
    if marker is not None and _is_marker(marker):
        return
    if marker is not None or (_entries(run_url, options) and not _has_run_start(run_url, options)):
        raise PetatrainError(
            f"--run-dir {run_url} is a non-empty folder that is not a petatrain run; choose a new or empty folder"
        )
    record = {"format": FORMAT, "version": VERSION, "created": time.time()}
    atomic_write(join(run_url, MARKER), json.dumps(record).encode(), options)


def _is_marker(raw: bytes) -> bool:
    try:
        record = json.loads(raw)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("format") == FORMAT and type(record.get("version")) is int


def _read(run_url: str, name: str, options: StorageOptions | None) -> bytes | None:
    fs, path = resolve(join(run_url, name), options)
    try:
        return retrying(f"read {run_url}/{name}", lambda: fs.cat_file(path))
    except (FileNotFoundError, IsADirectoryError):
        return None


def _entries(run_url: str, options: StorageOptions | None) -> list[str]:
    fs, path = resolve(run_url, options)
    try:
        return retrying(f"list {run_url}", lambda: fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def _has_run_start(run_url: str, options: StorageOptions | None) -> bool:
    """A run made before the marker: its ledger has a `run_start` event (the first one it wrote)."""
    fs, path = resolve(join(run_url, EVENTS_FILE), options)
    try:
        with fs.open(path, "rb") as handle:
            for line in handle:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a torn line
                if isinstance(event, dict) and event.get("event") == "run_start":
                    return True
    except (FileNotFoundError, IsADirectoryError):
        return False
    return False
