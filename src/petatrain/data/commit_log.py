"""A dataset's commit log: one `dataset.committed` event per version, on the object store beside it.

Every commit (ingest, an append, `--register`) writes `DATASET/_events/vNNNNNNNN.json` once, after
the manifest that makes the version: the version, its totals, what it added (rows, tokens, shards,
duplicates dropped, records rejected) and the SHA-256 of the version's record as written. A poller
(`petatrain loop`, an Airflow sensor, a script) reads the versions after the last one it handled:
`read(url, after=N)`, or `petatrain dataset events DATASET --after N`.

The log is append-only by construction: one object per version, and a version is committed by one
writer under the dataset's lease. It never misses a version: a version committed without its event
(the event's write failed after the commit, a key rotation, a dataset older than the log) is read
from its version record instead (`derived: true`; what the ingest counted but the record does not
hold is then left out). `dataset gc` removes old version records, never events: the log outlives
the versions it names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from petatrain.data import index
from petatrain.data.manifest import Manifest
from petatrain.errors import CorruptDataError
from petatrain.storage import StorageOptions, join, read_bytes
from petatrain.storage.fs import atomic_write, numbered

log = logging.getLogger(__name__)

LOG = "_events"
KIND = "dataset.committed"


def event_path(version: int) -> str:
    return f"{LOG}/v{version:08d}.json"


def committed(url: str, manifest: Manifest, previous: Manifest | None, record: bytes) -> dict[str, Any]:
    """The event of a version: `manifest` as committed (its record's bytes: `record`), against the one before."""
    now, before = manifest.totals, previous.totals if previous is not None else None

    def added(field: str) -> int:
        return getattr(now, field) - (getattr(before, field) if before is not None else 0)

    rejected = sum(now.rejected.values()) - (sum(before.rejected.values()) if before is not None else 0)
    return {
        "event": KIND,
        "dataset": url,
        "version": manifest.generation,
        "committed": manifest.updated,
        "kind": manifest.kind,
        "rows": now.rows,
        "tokens": now.tokens,
        "shards": now.shards,
        "rows_added": added("rows"),
        "tokens_added": added("tokens"),
        "shards_added": added("shards"),
        "duplicates_dropped": added("exact_duplicates") + added("near_duplicates"),
        "rejected": rejected,
        "manifest_sha256": hashlib.sha256(record).hexdigest(),
    }


def record(url: str, event: dict[str, Any], options: StorageOptions | None = None) -> None:
    """Write a version's event. The version is already committed: a failed write is a warning, and
    `read` derives the event from the version's record."""
    try:
        atomic_write(join(url, event_path(event["version"])), json.dumps(event, sort_keys=True).encode(), options)
    except Exception as exc:
        version = event["version"]
        log.warning("%s v%d is committed; its event was not written (%s): read from its record", url, version, exc)


def read(url: str, after: int = 0, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """The `dataset.committed` events of the versions after `after`, oldest first."""
    root = index.split_version(url)[0]
    written = _written(root, options)
    versions = sorted(v for v in written | set(index.version_numbers(root, options)) if v > after)
    events = []
    for version in versions:
        event = _read_written(root, version, options) if version in written else None
        events.append(event if event is not None else _derived(root, version, options))
    return events


def _written(root: str, options: StorageOptions | None) -> set[int]:
    return set(numbered(join(root, LOG), "v", options))


def _read_written(root: str, version: int, options: StorageOptions | None) -> dict[str, Any] | None:
    where = join(root, event_path(version))
    try:
        event = json.loads(read_bytes(where, options))
    except (ValueError, UnicodeDecodeError):
        log.warning("%s is not JSON: v%d read from its version record", where, version)
        return None
    if not (isinstance(event, dict) and event.get("event") == KIND and event.get("version") == version):
        log.warning("%s is not the event of v%d: read from its version record", where, version)
        return None
    return {**event, "dataset": root}  # where it is read from now (a copied or moved dataset)


def _record(root: str, version: int, options: StorageOptions | None) -> tuple[Manifest, bytes] | None:
    try:
        data = read_bytes(join(root, index.version_path(version)), options)
    except FileNotFoundError:
        return None
    try:
        return Manifest.from_dict(json.loads(data)), data
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"{root}: the record of v{version} is not a manifest ({exc})") from None


def _derived(root: str, version: int, options: StorageOptions | None) -> dict[str, Any]:
    """A version's event from its record (and the record before it, for what it added)."""
    found = _record(root, version, options)
    if found is None:  # removed by gc between the listing and now, with no event: nothing to say of it
        return {"event": KIND, "dataset": root, "version": version, "derived": True, "removed": True}
    manifest, data = found
    before = _record(root, version - 1, options) if version > 1 else None
    event = committed(root, manifest, before[0] if before else None, data)
    if version > 1 and before is None:  # the version before it was removed: its event has its totals
        previous = _read_written(root, version - 1, options)
        for field in ("rows", "tokens", "shards"):
            event[f"{field}_added"] = event[field] - previous[field] if previous is not None else None
        event["duplicates_dropped"] = event["rejected"] = None  # the event holds no totals of those
    return {**event, "derived": True}
