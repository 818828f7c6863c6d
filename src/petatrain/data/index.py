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
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data.buffers import arrow_reader
from petatrain.data.manifest import FORMAT, VERSION, IndexFile, Manifest, now
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.security import parquet_crypt, signing
from petatrain.security.keys import open_keys
from petatrain.security.parquet_crypt import DatasetKeys
from petatrain.security.protection import protection_of
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
from petatrain.storage.fs import numbered, refuse_linked_entries, to_url
from petatrain.storage.lock import LEASE_FILE, Lease

MANIFEST = "_index/manifest.json"
# Every commit's manifest, kept: `DATASET@vN` opens version N (the Nth commit, `Manifest.generation`)
# as it was committed, with the shard index it named, however many appends came since.
VERSIONS = "_index/versions"
_VERSIONED = re.compile(r"^(?P<root>.+)@v(?P<version>[0-9]+)$")
SHARD_INDEX = "_index/shards.parquet"
CREATED = "_index/created.json"  # written first by a first ingest: the folder is ours before its manifest exists

SHARD_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("checksum", pa.string()),
        ("first_row", pa.int64()),
        ("key", pa.string()),  # the dataset key that encrypts the shard ("": plaintext)
        ("sha256", pa.string()),  # of the shard's bytes, when the dataset is signed ("" otherwise)
    ]
)


@dataclass(slots=True)
class Dataset:
    """A committed dataset: its URL, manifest and shard index."""

    url: str
    manifest: Manifest
    shards: pa.Table
    options: StorageOptions | None = None

    @property
    def num_rows(self) -> int:
        return self.manifest.totals.rows

    def shard_url(self, path: str) -> str:
        return shard_url(self.url, self.manifest, path)


def shard_url(url: str, manifest: Manifest, path: str) -> str:
    """The URL of a shard the index lists: relative paths stay inside the dataset, and only a
    registered dataset (files indexed in place) may name absolute ones."""
    absolute = "://" in path or path.startswith("/")
    if absolute and manifest.registered:
        return path
    parts = path.split("/")
    if absolute or not path or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise CorruptDataError(f"{url}: the shard index names {path!r}, outside the dataset; the index is corrupt")
    return join(url, path)


def split_version(url: str) -> tuple[str, int | None]:
    """`DATASET@vN` -> (DATASET, N); a bare URL -> (URL, None): its latest version."""
    found = _VERSIONED.match(url.rstrip("/"))
    if found is None:
        return url, None
    return found["root"], int(found["version"])


def versioned(url: str, version: int) -> str:
    """The URL that opens version `version` of the dataset at `url` (bare or versioned)."""
    return f"{split_version(url)[0].rstrip('/')}@v{version}"


def version_path(version: int) -> str:
    return f"{VERSIONS}/v{version:08d}.json"


def _manifest_file(root: str, version: int | None, options: StorageOptions | None) -> str | None:
    """Where version `version` (None: the latest) of the dataset at `root` is recorded; None when no
    dataset is committed there. A version committed before versions were kept is only the latest."""
    latest = join(root, MANIFEST)
    if version is None:
        return latest if exists(latest, options) else None
    kept = join(root, version_path(version))
    if exists(kept, options):
        return kept
    if not exists(latest, options):
        return None
    current = _generation(latest, options)
    if current == version:
        return latest
    kept_versions = _listed(version_numbers(root, options) or [current])
    if version > current:
        raise PetatrainError(f"{root} has no version {version}: its versions are {kept_versions}")
    raise PetatrainError(
        f"{root}@v{version} is not kept (committed before petatrain kept every version, or removed since); "
        f"its versions are {kept_versions}"
    )


def _listed(numbers: list[int]) -> str:
    """v1-v4, v6 for [1, 2, 3, 4, 6]."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"v{r[0]}" if len(r) == 1 else f"v{r[0]}-v{r[-1]}" for r in runs)


def _generation(target: str, options: StorageOptions | None) -> int:
    try:
        value = json.loads(read_bytes(target, options)).get("generation", 0)
    except (ValueError, AttributeError):
        return -1
    return value if isinstance(value, int) else -1


def read_manifest(url: str, options: StorageOptions | None = None) -> Manifest | None:
    """The manifest of the dataset at `url` (`DATASET@vN`: of version N), or None if there is no
    committed dataset."""
    root, version = split_version(url)
    target = _manifest_file(root, version, options)
    if target is None:
        return None
    url = root
    try:
        manifest = json.loads(read_bytes(target, options))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"{target} is not valid JSON ({exc}); the dataset index is corrupt") from None
    if not isinstance(manifest, dict):
        raise CorruptDataError(f"{target} is corrupt: a {type(manifest).__name__}, not a JSON object")
    if manifest.get("format") != FORMAT:
        raise PetatrainError(f"{url} is not a petatrain dataset (manifest format {manifest.get('format')!r})")
    if not isinstance(manifest.get("version", 0), int) or manifest.get("version", 0) > VERSION:
        raise PetatrainError(f"{url} was written by a newer petatrain (format version {manifest['version']})")
    signed = signing.check(
        options, signing.canonical(manifest), manifest.get("signature"), target,
        unsigned_ok=options is not None and options.trusts_unsigned(url),
        unsigned_hint=f" (a dataset nobody signed is read with storage.signing.unsigned: [{url}])",
    )  # fmt: skip
    try:
        parsed = Manifest.from_dict(manifest)
    except CorruptDataError as exc:
        raise CorruptDataError(f"corrupt manifest {target}: {exc}") from None
    if version is not None and parsed.generation != version:
        raise CorruptDataError(f"{target} records version {parsed.generation}, not {version}; the dataset is damaged")
    signature = manifest.get("signature")
    parsed.signed = signed
    parsed.signed_by = str(signature.get("key_id", "")) if isinstance(signature, dict) else ""
    return parsed


def dataset_keys(url: str, manifest: Manifest, options: StorageOptions | None) -> DatasetKeys | None:
    """The keys that decrypt the dataset's shards (None: none is encrypted); one line if none is configured."""
    if manifest.encryption is None:
        return None
    protection = protection_of(options)
    keyref = protection.encryption_key
    if not keyref:
        raise PetatrainError(
            f"{url} is encrypted; set storage.encryption.key to the keyring it was written with "
            "(--set storage.encryption.key=file:PATH)"
        )
    return parquet_crypt.from_record(keyref, manifest.encryption, join(url, MANIFEST), protection.kms_credentials)


def rewrap_dataset(url: str, options: StorageOptions) -> dict[str, Any]:
    """Re-wrap the dataset keys in the manifest with the keyring's primary version (`keys rotate`);
    no shard is rewritten. Holds the dataset's lease, so no ingest commits meanwhile."""
    with Lease(join(url, LEASE_FILE), kind="keys", what=url, options=options):
        manifest = read_manifest(url, options)
        if manifest is None:
            raise PetatrainError(f"no dataset at {url} (missing {MANIFEST})")
        keys = dataset_keys(url, manifest, options)
        if keys is None:
            return {"dataset": url, "keys": 0}
        fresh = keys.rewrapped()
        previous = read_manifest(url, options)
        manifest.encryption = fresh.record
        commit_manifest(url, manifest, previous, options)
        return {
            "dataset": url,
            "keys": len(fresh.wrapped),
            "key_version": open_keys(keys.keyref, keys.kms_credentials).primary,
        }


def open_dataset(url: str, options: StorageOptions | None = None, *, cache_dir: str | None = None) -> Dataset:
    """The committed dataset at `url` (`DATASET@vN`: version N of it); with `cache_dir`, its shard
    index is kept there, keyed by the manifest, so the processes of a node fetch it once."""
    manifest = read_manifest(url, options)
    if manifest is None:
        raise PetatrainError(f"no dataset at {url} (missing {MANIFEST})")
    url = split_version(url)[0]
    local = None
    if cache_dir:
        key = hashlib.sha256(json.dumps(manifest.to_dict(), sort_keys=True).encode()).hexdigest()[:24]
        local = os.path.join(cache_dir, f"index-{key}.parquet")
    shards = read_shard_index(url, manifest, options, local_copy=local)
    return Dataset(url=url, manifest=manifest, shards=shards, options=options)


def token_dtype(url: str, manifest: Manifest) -> np.dtype:
    """The dtype of the dataset's token ids, checked against its vocabulary and packed width,
    so that a changed manifest cannot make the loader reinterpret the bytes."""
    meta = manifest.tokenizer
    if meta is None:
        return np.dtype("uint16")
    try:
        dtype = np.dtype(meta.dtype)
    except TypeError:
        raise CorruptDataError(f"{url}: the manifest's token dtype {meta.dtype!r} is not a dtype") from None
    expected = np.dtype("uint16") if meta.vocab_size <= 65535 else np.dtype("uint32")
    pack, width = manifest.pack_length, manifest.column_type("tokens")
    if dtype != expected or (pack and width and width != f"fixed_size_binary[{pack * dtype.itemsize}]"):
        raise CorruptDataError(
            f"{url}: the manifest's token dtype {dtype.name} does not fit its vocabulary of "
            f"{meta.vocab_size} ids and rows of {pack} tokens ({width or 'no tokens column'}); "
            "the manifest is corrupt"
        )
    return dtype


def read_shard_index(
    url: str, manifest: Manifest, options: StorageOptions | None = None, *, local_copy: str | None = None
) -> pa.Table:
    """The committed shard rows. With `local_copy`, the index file is fetched once into
    that path and read from there afterwards (once per node for a shared cache folder)."""
    count = manifest.totals.shards
    if count == 0:
        return SHARD_SCHEMA.empty_table()
    recorded = manifest.index  # datasets written before the index was checksummed have none
    target = join(url, _index_path(url, recorded))
    try:
        source = _cached_index(local_copy, recorded, signed=manifest.signed) if local_copy else None
        if source is None:
            data = read_bytes(target, options)
            if recorded:
                _verify_index(data, recorded, target, signed=manifest.signed)
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
    for name in ("key", "sha256"):  # an index written before shards could be encrypted or signed
        if name not in table.column_names:
            table = table.append_column(name, pa.array([""] * table.num_rows, pa.string()))
    if manifest.signed and not all(table.column("sha256").to_pylist()):
        raise CorruptDataError(f"{target}: a shard of the signed dataset has no SHA-256")
    _check_counts(table, manifest.totals.rows, target)
    return table.select(SHARD_SCHEMA.names)


def _verify_index(data: bytes | memoryview, recorded: IndexFile, where: str, *, signed: bool = False) -> None:
    actual = checksum_bytes(data)
    if actual != recorded.checksum:
        raise CorruptDataError(
            f"the shard index {where} does not match its checksum in the manifest "
            f"({actual} != {recorded.checksum}); the index is corrupt or was changed"
        )
    if signed and signing.sha256_hex(data) != recorded.sha256:
        raise CorruptDataError(f"the shard index {where} does not match the SHA-256 in the signed manifest")


def _cached_index(local_copy: str, recorded: IndexFile | None, *, signed: bool) -> pa.MemoryMappedFile | None:
    """The node's copy of the index, verified against the manifest; None (refetch) if absent or stale."""
    try:
        mapped = pa.memory_map(local_copy)
    except FileNotFoundError:
        return None
    if recorded:
        try:
            _verify_index(memoryview(mapped.read_buffer()), recorded, local_copy, signed=signed)
        except CorruptDataError:
            os.unlink(local_copy)
            return None
        mapped.seek(0)
    return mapped


def int64s(column: pa.ChunkedArray) -> np.ndarray:
    """An int64 column of the shard index as numpy, via its buffer: pyarrow's to_numpy on a
    chunked column imports pandas (~0.3 s of every loader's start)."""
    if not pa.types.is_int64(column.type):
        raise CorruptDataError(f"a shard index count column is {column.type}, not int64")
    array = column.combine_chunks()
    if array.null_count:
        raise CorruptDataError(f"shard index column {column.type} has nulls")
    return np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array), offset=array.offset * 8)


def _check_counts(table: pa.Table, total_rows: int, where: str) -> None:
    """Row counts must be non-negative, `first_row` their running sum, and the sum the manifest's total."""
    rows = int64s(table.column("rows"))
    first = int64s(table.column("first_row"))
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


def _index_path(url: str, recorded: IndexFile | None) -> str:
    if not recorded:
        return SHARD_INDEX
    path = recorded.path
    if not (path.startswith("_index/shards-") and path.endswith(".parquet") and "/" not in path[7:]):
        raise CorruptDataError(f"{url}: the manifest names {path!r} as its shard index; the manifest is corrupt")
    return path


def write_shard_index(url: str, table: pa.Table, options: StorageOptions | None = None) -> IndexFile:
    """Write a new index file; returns what the manifest records of it.

    Every commit writes its index under a new name, so a writer that fails before its
    manifest is published leaves the committed index as it was.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table.cast(SHARD_SCHEMA), sink)
    path = f"_index/shards-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.parquet"
    data = sink.getvalue().to_pybytes()
    checksum, size = atomic_write(join(url, path), data, options)
    sha = signing.sha256_hex(data) if signing.signs(options) else ""
    return IndexFile(path=path, checksum=checksum, bytes=size, sha256=sha)


def remove_old_indexes(url: str, manifest: Manifest, previous: Manifest | None, options=None) -> None:
    """After a commit: drop index files that no kept version, nor the new or the previous manifest
    names (a writer that failed before its commit leaves one; a reader that read the previous
    manifest a moment ago may still fetch its index)."""
    keep = {_index_path(url, m.index).rsplit("/", 1)[-1] for m in (manifest, previous) if m}
    keep |= _versions_indexes(url, options)
    fs, path = resolve(join(url, "_index"), options)
    for found in retrying(f"list {url}/_index", lambda: fs.ls(path, detail=False)):
        name = found.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("shards") and name.endswith(".parquet") and name not in keep:
            remove_tree(join(url, "_index", name), options)


def append_shards(
    url: str, manifest: Manifest | None, shards: list[dict[str, Any]], options: StorageOptions | None = None
) -> IndexFile:
    """Write the shard index: the committed rows, then `shards` (path, rows, bytes, checksum).

    Only the index file is written; the new rows count once a manifest carrying the
    returned file as its `index` says so.
    """
    old = read_shard_index(url, manifest, options) if manifest else SHARD_SCHEMA.empty_table()
    first_row = manifest.totals.rows if manifest else 0
    rows = []
    for shard in shards:
        row = {k: shard[k] for k in ("path", "rows", "bytes", "checksum")}
        rows.append({**row, "first_row": first_row, "key": shard.get("key", ""), "sha256": shard.get("sha256", "")})
        first_row += shard["rows"]
    return write_shard_index(url, pa.concat_tables([old, pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)]), options)


def check_folder(url: str, options: StorageOptions | None = None) -> None:
    """Refuse someone else's non-empty folder as `--out`, before anything is written (a first
    ingest that crashed before its manifest left the marker: that folder is ours)."""
    folder.check(url, CREATED, kind=FORMAT, noun="petatrain dataset", what=f"--out {url}", options=options)


def refuse_links(url: str) -> None:
    """Refuse a local dataset with a symbolic link among what a writer writes (data/ itself, not
    each shard; _index/ and _rejects/ and what they hold), before anything is written."""
    refuse_linked_entries(url, descend=("_index", "_rejects"))


def mark_folder(url: str, options: StorageOptions | None = None) -> None:
    """Mark `url` a dataset in the making (holding its lease, before any other write)."""
    folder.mark(url, CREATED, kind=FORMAT, options=options)


def commit_manifest(
    url: str, manifest: Manifest, previous: Manifest | None, options: StorageOptions | None = None
) -> bytes:
    """Publish `manifest` if the dataset is still at `previous` (the manifest this writer started
    from); the fence behind the writer's lease, in case the lease was lost while it worked. The
    version's record, as written."""
    if read_manifest(url, options) != previous:
        raise PetatrainError(
            f"{url} changed while this ingest ran (another writer committed); nothing was published. "
            "Run the ingest again"
        )
    manifest.generation = (previous.generation if previous else 0) + 1
    return write_manifest(url, manifest, options)


def write_manifest(url: str, manifest: Manifest, options: StorageOptions | None = None) -> bytes:
    """Publish the manifest, signed when a signing key is configured (over its canonical JSON, which
    holds the index's SHA-256, which holds every shard's): first as its version's record, kept
    (`_index/versions/`), then as the latest (`_index/manifest.json`, the commit point)."""
    manifest.updated = now()
    record = manifest.to_dict()
    if signing.signs(options):
        index = manifest.index
        if index is not None and not index.sha256:
            raise PetatrainError(f"{url}: cannot sign a manifest whose index has no SHA-256 (written unsigned)")
        record["signature"] = signing.sign(options, signing.canonical(record))
    data = json.dumps(record, indent=2, sort_keys=True).encode()
    atomic_write(join(url, version_path(manifest.generation)), data, options)
    atomic_write(join(url, MANIFEST), data, options)
    return data


def version_numbers(url: str, options: StorageOptions | None = None) -> list[int]:
    """The versions of the dataset at `url` whose records are kept (`_index/versions/vN.json`), ascending."""
    return numbered(join(split_version(url)[0], VERSIONS), "v", options)


def _versions_indexes(url: str, options: StorageOptions | None) -> set[str]:
    """The names of the shard index files the kept versions name (the files an old version opens)."""
    fs, path = resolve(join(url, VERSIONS), options)
    try:
        names = retrying(f"list {url}/{VERSIONS}", lambda: fs.ls(path, detail=False))
    except FileNotFoundError:
        return set()
    found = set()
    for name in names:
        try:
            index = json.loads(read_bytes(to_url(fs, name), options)).get("index") or {}
        except (ValueError, AttributeError, OSError):
            continue  # not a version record: nothing it names is kept for it
        if isinstance(index, dict) and isinstance(index.get("path"), str):
            found.add(index["path"].rsplit("/", 1)[-1])
    return found


def verify_shards(dataset: Dataset) -> list[str]:
    """Re-hash every shard; returns one line per missing or corrupt shard. An encrypted shard is
    decrypted whole, so every page's authentication tag is checked too (the keyring is needed)."""
    problems = []
    shards = dataset.shards
    crypt = dataset_keys(dataset.url, dataset.manifest, dataset.options)
    for path, checksum, rows, key, sha in zip(
        shards.column("path").to_pylist(),
        shards.column("checksum").to_pylist(),
        shards.column("rows").to_pylist(),
        shards.column("key").to_pylist(),
        shards.column("sha256").to_pylist(),
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
        if dataset.manifest.signed and signing.sha256_hex(data) != sha:
            problems.append(f"corrupt: {target} does not match the SHA-256 of the signed index")
            continue
        try:
            if key:
                stored = parquet_crypt.open_parquet(arrow_reader(data), crypt).read().num_rows
            else:
                stored = pq.ParquetFile(arrow_reader(data)).metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"corrupt: {target} is not readable Parquet ({exc})")
            continue
        if stored != rows:
            problems.append(f"corrupt: {target} holds {stored} rows; the index says {rows}")
    return problems
