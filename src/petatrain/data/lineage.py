"""A dataset's lineage: which source files it was built from, as Parquet tables beside the index.

At 10^6-10^7 source files a JSON list in the manifest would make every open parse gigabytes;
instead each commit writes its batch's sources as one table (`_index/lineage/`) and the
manifest keeps only the totals and the tables' names and checksums. Opening a dataset (the
loader, `inspect`) never reads them; an `--append` reads them to tell new files from ingested
ones. Datasets written before (manifest version 1) list their sources in the manifest: they
read as they are, and their first append moves that list into a table.
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data.buffers import arrow_reader
from petatrain.data.manifest import Batch, Lineage, LineagePart, Manifest, Source
from petatrain.errors import CorruptDataError
from petatrain.security import signing
from petatrain.storage import StorageOptions, atomic_write, join, read_bytes, remove_tree, resolve, retrying
from petatrain.storage.checksum import checksum_bytes

FOLDER = "_index/lineage"
LINEAGE_SCHEMA = pa.schema(
    [
        ("url", pa.string()),
        ("size", pa.int64()),
        ("fingerprint", pa.string()),
        ("checksum", pa.string()),
        ("batch", pa.int64()),
        ("file_ord", pa.int64()),  # null for registered files: ingest did not read them
    ]
)


def sources_table(sources: list[Source]) -> pa.Table:
    columns = {name: [getattr(s, name) for s in sources] for name in LINEAGE_SCHEMA.names}
    return pa.table(columns, schema=LINEAGE_SCHEMA)


def write_part(url: str, table: pa.Table, options: StorageOptions | None = None) -> LineagePart:
    """Write one lineage table under a new name (a failed commit leaves the committed ones as they were)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table.cast(LINEAGE_SCHEMA), sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    path = f"{FOLDER}/{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.parquet"
    checksum, size = atomic_write(join(url, path), data, options)
    sha = signing.sha256_hex(data) if signing.signs(options) else ""
    return LineagePart(path=path, checksum=checksum, bytes=size, rows=table.num_rows, sha256=sha)


def read_sources(
    url: str, manifest: Manifest, options: StorageOptions | None = None, *, columns: list[str] | None = None
) -> pa.Table:
    """Every source row of the dataset (`LINEAGE_SCHEMA`, or only `columns` of it), each table
    checked against its checksum."""
    schema = pa.schema([LINEAGE_SCHEMA.field(c) for c in columns]) if columns else LINEAGE_SCHEMA
    tables = [sources_table(manifest.lineage.sources).select(schema.names)] if manifest.lineage.sources else []
    for part in manifest.lineage.parts:
        if not (part.path.startswith(f"{FOLDER}/") and part.path.endswith(".parquet") and ".." not in part.path):
            raise CorruptDataError(
                f"{url}: the manifest names {part.path!r} as a lineage table; the manifest is corrupt"
            )
        target = join(url, part.path)
        try:
            data = read_bytes(target, options)
        except FileNotFoundError:
            raise CorruptDataError(f"{target} is missing; the manifest lists it as lineage") from None
        if checksum_bytes(data) != part.checksum:
            raise CorruptDataError(f"the lineage table {target} does not match its checksum in the manifest")
        if manifest.signed and signing.sha256_hex(data) != part.sha256:
            raise CorruptDataError(f"the lineage table {target} does not match the SHA-256 in the signed manifest")
        tables.append(pq.ParquetFile(arrow_reader(data)).read(columns=schema.names).cast(schema))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def extended(
    url: str, manifest: Manifest | None, sources: list[Source], batch: Batch, options: StorageOptions | None = None
) -> Lineage:
    """The lineage after a commit that adds `sources` as `batch` (only their table is written;
    a version-1 manifest's inline list becomes a table of its own the first time)."""
    before = manifest.lineage if manifest else Lineage()
    parts = list(before.parts)
    if before.sources:
        parts.append(write_part(url, sources_table(before.sources), options))
    if sources:
        parts.append(write_part(url, sources_table(sources), options))
    return Lineage(
        batches=[*before.batches, batch],
        next_file_ord=before.next_file_ord + len(sources),
        parts=parts,
        source_count=before.num_sources + len(sources),
    )


def replaced(
    url: str, manifest: Manifest, sources: list[Source], batch: Batch, options: StorageOptions | None = None
) -> Lineage:
    """The lineage of a re-registered folder: its batches so far plus this one, and exactly `sources`."""
    return Lineage(
        batches=[*manifest.lineage.batches, batch],
        next_file_ord=manifest.lineage.next_file_ord,
        parts=[write_part(url, sources_table(sources), options)] if sources else [],
        source_count=len(sources),
    )


def remove_unused(url: str, manifest: Manifest, previous: Manifest | None, options: StorageOptions | None) -> None:
    """After a commit: drop lineage tables neither the new nor the previous manifest names
    (as `index.remove_old_indexes` does for index files)."""
    keep = {p.path.rsplit("/", 1)[-1] for m in (manifest, previous) if m for p in m.lineage.parts}
    fs, path = resolve(join(url, FOLDER), options)
    try:
        found = retrying(f"list {url}/{FOLDER}", lambda: fs.ls(path, detail=False))
    except FileNotFoundError:
        return
    for name in (f.rstrip("/").rsplit("/", 1)[-1] for f in found):
        if name.endswith(".parquet") and name not in keep:
            remove_tree(join(url, FOLDER, name), options)
