"""The dataset index: `_index/manifest.json` (the commit point) and `_index/shards.parquet`.

A dataset is what its manifest says. Shards, rejects and dedup state are written first;
the manifest is written last, atomically. The shard index only grows: an append writes
new rows after the old ones, so a reader that takes the first `totals.shards` rows sees
exactly the committed dataset even if a crashed append left a longer index behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data.buffers import arrow_reader
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage import StorageOptions, atomic_write, exists, join, read_bytes
from petatrain.storage.checksum import ChecksumMismatch, checksum_bytes

FORMAT = "petatrain.dataset"
VERSION = 1
MANIFEST = "_index/manifest.json"
SHARD_INDEX = "_index/shards.parquet"

SHARD_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("checksum", pa.string()),
        ("first_row", pa.int64()),
    ]
)


@dataclass(slots=True)
class Dataset:
    """A committed dataset: its URL, manifest and shard index."""

    url: str
    manifest: dict[str, Any]
    shards: pa.Table
    options: StorageOptions | None = None

    @property
    def num_rows(self) -> int:
        return int(self.manifest["totals"]["rows"])

    def shard_url(self, path: str) -> str:
        """Shards petatrain wrote are relative to the dataset; registered ones are absolute."""
        return path if "://" in path or path.startswith("/") else join(self.url, path)


def read_manifest(url: str, options: StorageOptions | None = None) -> dict[str, Any] | None:
    """The manifest of the dataset at `url`, or None if there is no committed dataset."""
    target = join(url, MANIFEST)
    if not exists(target, options):
        return None
    try:
        manifest = json.loads(read_bytes(target, options))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"{target} is not valid JSON ({exc}); the dataset index is corrupt") from None
    if manifest.get("format") != FORMAT:
        raise PetatrainError(f"{url} is not a petatrain dataset (manifest format {manifest.get('format')!r})")
    if manifest.get("version", 0) > VERSION:
        raise PetatrainError(f"{url} was written by a newer petatrain (format version {manifest['version']})")
    return manifest


def open_dataset(url: str, options: StorageOptions | None = None, *, cache_dir: str | None = None) -> Dataset:
    """The committed dataset at `url`; with `cache_dir`, its shard index is kept there,
    keyed by the manifest, so the processes of a node fetch it once."""
    manifest = read_manifest(url, options)
    if manifest is None:
        raise PetatrainError(f"no dataset at {url} (missing {MANIFEST})")
    local = None
    if cache_dir:
        key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:24]
        local = os.path.join(cache_dir, f"index-{key}.parquet")
    shards = read_shard_index(url, manifest, options, local_copy=local)
    return Dataset(url=url, manifest=manifest, shards=shards, options=options)


def read_shard_index(
    url: str, manifest: dict[str, Any], options: StorageOptions | None = None, *, local_copy: str | None = None
) -> pa.Table:
    """The committed shard rows. With `local_copy`, the index file is fetched once into
    that path and read from there afterwards (once per node for a shared cache folder)."""
    count = int(manifest["totals"]["shards"])
    if count == 0:
        return SHARD_SCHEMA.empty_table()
    target = join(url, SHARD_INDEX)
    try:
        if local_copy and os.path.exists(local_copy):
            source = pa.memory_map(local_copy)
        else:
            data = read_bytes(target, options)
            if local_copy:
                os.makedirs(os.path.dirname(local_copy), exist_ok=True)
                tmp = f"{local_copy}.{os.getpid()}.tmp"
                with open(tmp, "wb") as handle:
                    handle.write(data)
                os.replace(tmp, local_copy)
            source = arrow_reader(data)
        # ParquetFile.read, unlike pq.read_table, does not import pyarrow.dataset (and pandas):
        # ~0.3 s off every loader's start.
        table = pq.ParquetFile(source).read()
    except FileNotFoundError:
        raise CorruptDataError(f"{target} is missing; the manifest lists {count} shards") from None
    except pa.ArrowException as exc:
        raise CorruptDataError(f"{target} is not readable Parquet ({exc})") from None
    if table.num_rows < count:
        raise CorruptDataError(f"{target} has {table.num_rows} rows; the manifest lists {count} shards")
    return table.slice(0, count)


def write_shard_index(url: str, table: pa.Table, options: StorageOptions | None = None) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(table.cast(SHARD_SCHEMA), sink)
    atomic_write(join(url, SHARD_INDEX), sink.getvalue().to_pybytes(), options)


def empty_totals() -> dict[str, Any]:
    return {
        "shards": 0,
        "rows": 0,
        "bytes": 0,
        "documents": 0,
        "rows_in": 0,
        "rejected": {},
        "exact_duplicates": 0,
        "near_duplicates": 0,
        "tokens": 0,
    }


def append_shards(
    url: str, manifest: dict[str, Any] | None, shards: list[dict[str, Any]], options: StorageOptions | None = None
) -> None:
    """Write the shard index: the committed rows, then `shards` (path, rows, bytes, checksum).

    Only the index file is written; the new rows count once the manifest says so.
    """
    old = read_shard_index(url, manifest, options) if manifest else SHARD_SCHEMA.empty_table()
    first_row = int(manifest["totals"]["rows"]) if manifest else 0
    rows = []
    for shard in shards:
        rows.append({**{k: shard[k] for k in ("path", "rows", "bytes", "checksum")}, "first_row": first_row})
        first_row += shard["rows"]
    write_shard_index(url, pa.concat_tables([old, pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)]), options)


def write_manifest(url: str, manifest: dict[str, Any], options: StorageOptions | None = None) -> None:
    manifest = dict(
        manifest, format=FORMAT, version=VERSION, updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    )
    atomic_write(join(url, MANIFEST), json.dumps(manifest, indent=2, sort_keys=True).encode(), options)


def verify_shards(dataset: Dataset) -> list[str]:
    """Re-hash every shard; returns one line per missing or corrupt shard."""
    problems = []
    for path, checksum in zip(
        dataset.shards.column("path").to_pylist(), dataset.shards.column("checksum").to_pylist(), strict=True
    ):
        target = dataset.shard_url(path)
        try:
            data = read_bytes(target, dataset.options)
        except FileNotFoundError:
            problems.append(f"missing: {target}")
            continue
        try:
            if checksum_bytes(data) != checksum:
                raise ChecksumMismatch(checksum_bytes(data))
        except ChecksumMismatch as exc:
            problems.append(f"corrupt: {target} (checksum {exc} != recorded {checksum})")
    return problems
