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
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data.buffers import arrow_reader
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage import (
    StorageOptions,
    atomic_write,
    exists,
    folder,
    join,
    read_bytes,
    remove_tree,
    resolve,
    retrying,
)
from petatrain.storage.checksum import checksum_bytes

FORMAT = "petatrain.dataset"
VERSION = 1
MANIFEST = "_index/manifest.json"
SHARD_INDEX = "_index/shards.parquet"
CREATED = "_index/created.json"  # written first by a first ingest: the folder is ours before its manifest exists
_REQUIRED = (("totals", dict), ("schema", list), ("lineage", dict))

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
        return shard_url(self.url, self.manifest, path)


def shard_url(url: str, manifest: dict[str, Any], path: str) -> str:
    """The URL of a shard the index lists: relative paths stay inside the dataset, and only a
    registered dataset (files indexed in place) may name absolute ones."""
    absolute = "://" in path or path.startswith("/")
    if absolute and manifest.get("registered"):
        return path
    parts = path.split("/")
    if absolute or not path or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise CorruptDataError(f"{url}: the shard index names {path!r}, outside the dataset; the index is corrupt")
    return join(url, path)


def read_manifest(url: str, options: StorageOptions | None = None) -> dict[str, Any] | None:
    """The manifest of the dataset at `url`, or None if there is no committed dataset."""
    target = join(url, MANIFEST)
    if not exists(target, options):
        return None
    try:
        manifest = json.loads(read_bytes(target, options))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"{target} is not valid JSON ({exc}); the dataset index is corrupt") from None
    if not isinstance(manifest, dict):
        raise CorruptDataError(f"{target} is corrupt: a {type(manifest).__name__}, not a JSON object")
    if manifest.get("format") != FORMAT:
        raise PetatrainError(f"{url} is not a petatrain dataset (manifest format {manifest.get('format')!r})")
    if manifest.get("version", 0) > VERSION:
        raise PetatrainError(f"{url} was written by a newer petatrain (format version {manifest['version']})")
    problem = _manifest_problem(manifest)
    if problem:
        raise CorruptDataError(f"corrupt manifest {target}: {problem}")
    return manifest


def _manifest_problem(manifest: dict[str, Any]) -> str:
    """What makes `manifest` unusable, or "": the fields every reader relies on, with their types."""

    def count(value: Any) -> bool:
        return type(value) is int and value >= 0

    for key, kind in _REQUIRED:
        if not isinstance(manifest.get(key), kind):
            return f"missing {key!r}" if key not in manifest else f"{key!r} is not a {kind.__name__}"
    totals, lineage = manifest["totals"], manifest["lineage"]
    for key in ("shards", "rows", "bytes"):
        if not count(totals.get(key)):
            return f"totals.{key} is {totals.get(key)!r}, not a count"
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in manifest["schema"]):
        return "schema is not a list of {name, type} columns"
    if not isinstance(lineage.get("sources", []), list) or not isinstance(lineage.get("batches", []), list):
        return "lineage.sources and lineage.batches must be lists"
    tokenizer = manifest.get("tokenizer")
    if tokenizer is not None and not (isinstance(tokenizer, dict) and count(tokenizer.get("vocab_size"))):
        return f"tokenizer {str(tokenizer)[:80]} has no vocab_size"
    return ""


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


def token_dtype(url: str, manifest: dict[str, Any]) -> np.dtype:
    """The dtype of the dataset's token ids, checked against its vocabulary and packed width,
    so that a changed manifest cannot make the loader reinterpret the bytes."""
    meta = manifest.get("tokenizer") or {}
    dtype = np.dtype(meta.get("dtype", "uint16"))
    if not meta:
        return dtype
    expected = np.dtype("uint16") if int(meta.get("vocab_size", 0)) <= 65535 else np.dtype("uint32")
    pack = int((manifest.get("ingest") or {}).get("pack_length") or 0)
    widths = [c["type"] for c in manifest.get("schema", []) if c.get("name") == "tokens"]
    if dtype != expected or (pack and widths and widths[0] != f"fixed_size_binary[{pack * dtype.itemsize}]"):
        raise CorruptDataError(
            f"{url}: the manifest's token dtype {dtype.name} does not fit its vocabulary of "
            f"{meta.get('vocab_size')} ids and rows of {pack} tokens ({widths[0] if widths else 'no tokens column'}); "
            "the manifest is corrupt"
        )
    return dtype


def read_shard_index(
    url: str, manifest: dict[str, Any], options: StorageOptions | None = None, *, local_copy: str | None = None
) -> pa.Table:
    """The committed shard rows. With `local_copy`, the index file is fetched once into
    that path and read from there afterwards (once per node for a shared cache folder)."""
    count = int(manifest["totals"]["shards"])
    if count == 0:
        return SHARD_SCHEMA.empty_table()
    recorded = manifest.get("index")  # datasets written before the index was checksummed have none
    target = join(url, _index_path(url, recorded))
    try:
        source = _cached_index(local_copy, recorded) if local_copy else None
        if source is None:
            data = read_bytes(target, options)
            if recorded:
                _verify_index(data, recorded, target)
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
    table = table.slice(0, count)
    _check_counts(table, int(manifest["totals"]["rows"]), target)
    return table


def _verify_index(data: bytes | memoryview, recorded: dict[str, Any], where: str) -> None:
    actual = checksum_bytes(data)
    if actual != recorded.get("checksum"):
        raise CorruptDataError(
            f"the shard index {where} does not match its checksum in the manifest "
            f"({actual} != {recorded.get('checksum')}); the index is corrupt or was changed"
        )


def _cached_index(local_copy: str, recorded: dict[str, Any] | None) -> pa.MemoryMappedFile | None:
    """The node's copy of the index, verified against the manifest; None (refetch) if absent or stale."""
    try:
        mapped = pa.memory_map(local_copy)
    except FileNotFoundError:
        return None
    if recorded:
        try:
            _verify_index(memoryview(mapped.read_buffer()), recorded, local_copy)
        except CorruptDataError:
            os.unlink(local_copy)
            return None
        mapped.seek(0)
    return mapped


def _check_counts(table: pa.Table, total_rows: int, where: str) -> None:
    """Row counts must be non-negative, `first_row` their running sum, and the sum the manifest's total."""
    rows = table.column("rows").to_numpy()
    first = table.column("first_row").to_numpy()
    if len(rows) == 0:
        if total_rows != 0:
            raise CorruptDataError(f"the shard index {where} lists no shards; the manifest counts {total_rows} rows")
        return
    if (rows < 0).any() or first[0] != 0 or (first[1:] != first[:-1] + rows[:-1]).any():
        bad = int(np.flatnonzero((rows < 0) | (first != np.concatenate(([0], np.cumsum(rows)[:-1]))))[0])
        raise CorruptDataError(
            f"the shard index {where} is corrupt: shard {bad} has rows={int(rows[bad])}, first_row={int(first[bad])}"
        )
    if int(first[-1] + rows[-1]) != total_rows:
        raise CorruptDataError(
            f"the shard index {where} counts {int(first[-1] + rows[-1])} rows; the manifest counts {total_rows}"
        )


def _index_path(url: str, recorded: dict[str, Any] | None) -> str:
    if not recorded:
        return SHARD_INDEX
    path = str(recorded.get("path", ""))
    if not (path.startswith("_index/shards-") and path.endswith(".parquet") and "/" not in path[7:]):
        raise CorruptDataError(f"{url}: the manifest names {path!r} as its shard index; the manifest is corrupt")
    return path


def write_shard_index(url: str, table: pa.Table, options: StorageOptions | None = None) -> dict[str, Any]:
    """Write a new index file; returns its `{"path", "checksum", "bytes"}` for the manifest.

    Every commit writes its index under a new name, so a writer that fails before its
    manifest is published leaves the committed index as it was.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table.cast(SHARD_SCHEMA), sink)
    path = f"_index/shards-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.parquet"
    checksum, size = atomic_write(join(url, path), sink.getvalue().to_pybytes(), options)
    return {"path": path, "checksum": checksum, "bytes": size}


def remove_old_indexes(url: str, manifest: dict[str, Any], previous: dict[str, Any] | None, options=None) -> None:
    """After a commit: drop index files neither the new nor the previous manifest names (a
    reader that read the previous manifest a moment ago may still fetch its index)."""
    keep = {_index_path(url, m.get("index")).rsplit("/", 1)[-1] for m in (manifest, previous) if m}
    fs, path = resolve(join(url, "_index"), options)
    for found in retrying(f"list {url}/_index", lambda: fs.ls(path, detail=False)):
        name = found.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("shards") and name.endswith(".parquet") and name not in keep:
            remove_tree(join(url, "_index", name), options)


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
) -> dict[str, Any]:
    """Write the shard index: the committed rows, then `shards` (path, rows, bytes, checksum).

    Only the index file is written; the new rows count once a manifest carrying the
    returned `{"checksum", "bytes"}` as its `index` says so.
    """
    old = read_shard_index(url, manifest, options) if manifest else SHARD_SCHEMA.empty_table()
    first_row = int(manifest["totals"]["rows"]) if manifest else 0
    rows = []
    for shard in shards:
        rows.append({**{k: shard[k] for k in ("path", "rows", "bytes", "checksum")}, "first_row": first_row})
        first_row += shard["rows"]
    return write_shard_index(url, pa.concat_tables([old, pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)]), options)


def check_folder(url: str, options: StorageOptions | None = None) -> None:
    """Refuse someone else's non-empty folder as `--out`, before anything is written (a first
    ingest that crashed before its manifest left the marker: that folder is ours)."""
    folder.check(url, CREATED, kind=FORMAT, noun="petatrain dataset", what=f"--out {url}", options=options)


def mark_folder(url: str, options: StorageOptions | None = None) -> None:
    """Mark `url` a dataset in the making (holding its lease, before any other write)."""
    folder.mark(url, CREATED, kind=FORMAT, options=options)


def commit_manifest(
    url: str, manifest: dict[str, Any], previous: dict[str, Any] | None, options: StorageOptions | None = None
) -> None:
    """Publish `manifest` if the dataset is still at `previous` (the manifest this writer started
    from); the fence behind the writer's lease, in case the lease was lost while it worked."""
    if read_manifest(url, options) != previous:
        raise PetatrainError(
            f"{url} changed while this ingest ran (another writer committed); nothing was published. "
            "Run the ingest again"
        )
    generation = int((previous or {}).get("generation", 0)) + 1
    write_manifest(url, dict(manifest, generation=generation), options)


def write_manifest(url: str, manifest: dict[str, Any], options: StorageOptions | None = None) -> None:
    manifest = dict(
        manifest, format=FORMAT, version=VERSION, updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    )
    atomic_write(join(url, MANIFEST), json.dumps(manifest, indent=2, sort_keys=True).encode(), options)


def verify_shards(dataset: Dataset) -> list[str]:
    """Re-hash every shard; returns one line per missing or corrupt shard."""
    problems = []
    shards = dataset.shards
    for path, checksum, rows in zip(
        shards.column("path").to_pylist(),
        shards.column("checksum").to_pylist(),
        shards.column("rows").to_pylist(),
        strict=True,
    ):
        try:
            target = dataset.shard_url(path)
        except CorruptDataError as exc:
            problems.append(f"corrupt index: {exc}")
            continue
        try:
            data = read_bytes(target, dataset.options)
        except FileNotFoundError:
            problems.append(f"missing: {target}")
            continue
        actual = checksum_bytes(data)
        if actual != checksum:
            problems.append(f"corrupt: {target} (checksum {actual} != recorded {checksum})")
            continue
        try:
            stored = pq.ParquetFile(arrow_reader(data)).metadata.num_rows
        except pa.ArrowException as exc:
            problems.append(f"corrupt: {target} is not readable Parquet ({exc})")
            continue
        if stored != rows:
            problems.append(f"corrupt: {target} holds {stored} rows; the index says {rows}")
    return problems
