"""A folder petatrain owns: it writes into a new or empty folder, or one carrying its marker,
and refuses anyone else's non-empty folder before writing anything (a dataset's `--out`, a
run's `--run-dir`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from petatrain.errors import PetatrainError
from petatrain.storage.fs import StorageOptions, atomic_write, join, resolve
from petatrain.storage.retry import retrying

_LEASE = "_lock"  # a lease (storage.lock) alone does not make a folder someone else's


def claim(
    url: str,
    marker: str,
    *,
    kind: str,
    noun: str,
    what: str,
    options: StorageOptions | None = None,
    ours_before_marker: Callable[[], bool] | None = None,
) -> None:
    """Write `url/marker` (`{"format": kind, "version": 1, "created": ...}`) unless it is there;
    a file, or a non-empty folder without the marker, is refused in one line naming `what`
    (e.g. "--out DIR") and `noun` ("petatrain dataset"). `ours_before_marker` recognises a
    folder petatrain made before it wrote markers."""
    fs, path = resolve(url, options)
    fs.invalidate_cache(path)
    if retrying(f"stat {url}", lambda: fs.isfile(path)):
        raise PetatrainError(f"{what} is a file, not a folder")
    raw = _read(join(url, marker), options)
    if raw is not None and _is_marker(raw, kind):
        return
    if raw is not None or (_entries(url, options) and not (ours_before_marker and ours_before_marker())):
        raise PetatrainError(f"{what} is a non-empty folder that is not a {noun}; choose a new or empty folder")
    record = {"format": kind, "version": 1, "created": time.time()}
    atomic_write(join(url, marker), json.dumps(record).encode(), options)


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
    names = [os.path.basename(str(e).rstrip("/")) for e in found]
    return [n for n in names if n != _LEASE and not n.startswith(f"{_LEASE}.")]
