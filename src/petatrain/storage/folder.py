"""A folder petatrain owns: it writes into a new or empty folder, or one carrying its marker
or a petatrain writer's lease, and refuses anyone else's non-empty folder before writing
anything (a dataset's `--out`, a run's `--run-dir`). `check` before taking the lease, `mark`
holding it: a first writer's marker can then never be half-written when a second one looks."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable

from petatrain.errors import PetatrainError
from petatrain.storage.fs import StorageOptions, atomic_write, join, resolve
from petatrain.storage.lock import LEASE_FILE
from petatrain.storage.retry import retrying


def check(
    url: str,
    marker: str,
    *,
    kind: str,
    noun: str,
    what: str,
    options: StorageOptions | None = None,
    ours_before_marker: Callable[[], bool] | None = None,
) -> bool:
    """Whether `url` is ours already (True: its marker is there); False for a new or empty
    folder, or one a petatrain writer holds a lease on (the lease decides between writers).
    A file, or someone else's non-empty folder, is refused in one line naming `what` (e.g.
    "--out DIR") and `noun` ("petatrain dataset"), before anything is written.
    `ours_before_marker` recognises a folder petatrain made before it wrote markers."""
    fs, path = resolve(url, options)
    fs.invalidate_cache(path)
    if retrying(f"stat {url}", lambda: fs.isfile(path)):
        raise PetatrainError(f"{what} is a file, not a folder")
    raw = _read(join(url, marker), options)
    if raw is not None and _is_marker(raw, kind):
        return True
    entries = _entries(url, options)
    leased = any(e == LEASE_FILE or e.startswith(f"{LEASE_FILE}.") for e in entries)  # or being taken
    if raw is None and (not entries or leased or (ours_before_marker and ours_before_marker())):
        return False
    raise PetatrainError(f"{what} is a non-empty folder that is not a {noun}; choose a new or empty folder")


def mark(url: str, marker: str, *, kind: str, options: StorageOptions | None = None) -> None:
    """Write the marker `check` looks for (call it holding the folder's lease)."""
    raw = _read(join(url, marker), options)
    if raw is None or not _is_marker(raw, kind):
        record = {"format": kind, "version": 1, "created": time.time(), "id": uuid.uuid4().hex}
        atomic_write(join(url, marker), json.dumps(record).encode(), options)


def unmark_if_bare(url: str, marker: str, options: StorageOptions | None = None, *, remove_folder: bool) -> None:
    """Undo `mark` where nothing else was written since (a writer refused before it started): the
    marker, then, with `remove_folder` (the writer made it), the folder if it is left empty (a local
    one; an object store has no empty folders). Call it after the lease is released."""
    if set(_entries(url, options)) - {marker}:
        return
    fs, path = resolve(url, options)
    try:
        retrying(f"remove {url}/{marker}", lambda: fs.rm_file(join(path, marker)))
        if remove_folder and not _entries(url, options) and fs.protocol in ("file", ("file", "local")):
            os.rmdir(path)
    except (FileNotFoundError, OSError):
        pass  # a marker left behind is harmless: the folder is a run nobody started


def _is_marker(raw: bytes, kind: str) -> bool:
    try:
        record = json.loads(raw)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("format") == kind and type(record.get("version")) is int


def _read(url: str, options: StorageOptions | None) -> bytes | None:
    fs, path = resolve(url, options)
    try:
        return retrying(f"read {url}", lambda: fs.cat_file(path))
    except (FileNotFoundError, IsADirectoryError):
        return None


def _entries(url: str, options: StorageOptions | None) -> list[str]:
    fs, path = resolve(url, options)
    try:
        found = retrying(f"list {url}", lambda: fs.ls(path, detail=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [os.path.basename(str(e).rstrip("/")) for e in found]


def identity(url: str, marker: str, options: StorageOptions | None = None) -> str:
    """The id in a folder's marker ("" for a folder marked before markers had one, or unmarked)."""
    raw = _read(join(url, marker), options)
    try:
        record = json.loads(raw) if raw is not None else {}
    except ValueError:
        return ""
    value = record.get("id") if isinstance(record, dict) else None
    return value if isinstance(value, str) else ""
