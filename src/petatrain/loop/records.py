"""The loop's record of each dataset version it handled: `RUNS/_loop/cycles/vNNNNNNNN.json`.

Written once, last, when a version's cycle is over (promoted, or refused by the gate with the
reason), so a loop killed anywhere before it does that version's cycle again, and every step of
it is idempotent (the append skips files it holds, the continuation resumes or returns its run,
the promotion of a registered version returns it). A version with a record is never trained again.
"""

from __future__ import annotations

import json
from typing import Any

from petatrain.errors import CorruptDataError
from petatrain.storage.fs import StorageOptions, atomic_write, join, numbered, read_bytes


def _path(state: str, version: int) -> str:
    return join(state, "cycles", f"v{version:08d}.json")


def read(state: str, version: int, options: StorageOptions | None = None) -> dict[str, Any] | None:
    """The record of `version`'s cycle, None if it has none yet."""
    path = _path(state, version)
    try:
        data = read_bytes(path, options)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
    except ValueError:  # a record is written atomically: this is damage, not a half-written file
        raise CorruptDataError(f"{path}: the loop's cycle record is not JSON; remove it to run it again") from None
    if not isinstance(record, dict) or record.get("version") != version:
        raise CorruptDataError(f"{path}: not the cycle record of version {version}; remove it to run the cycle again")
    return record


def write(state: str, record: dict[str, Any], options: StorageOptions | None = None) -> None:
    atomic_write(_path(state, int(record["version"])), json.dumps(record, indent=1).encode(), options)


def history(state: str, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """Every cycle record, oldest version first."""
    versions = numbered(join(state, "cycles"), "v", options)
    return [r for r in (read(state, v, options) for v in versions) if r is not None]
