"""`ingest --register`: index existing Parquet files (written by Spark, say) in place.

The files are not rewritten: the shard index records their URLs, row counts, sizes and
checksums, so readers and `inspect --verify` treat them like shards petatrain wrote. A
Hive-partitioned folder (`partitionBy("src")`: `src=web/part-*.parquet`) keeps its partition
values in folder names only; they become columns of the dataset (the manifest's
`partitions`), which the loader fills in from each shard's path.

`--refresh` re-registers a folder that was rewritten (Spark's `mode("overwrite")` writes new
file names): the index becomes exactly the folder's current files, files unchanged since the
last commit are not read again, and the summary says what was added, removed and changed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data import commit_log, lineage
from petatrain.data import index as idx
from petatrain.data.buffers import arrow_reader
from petatrain.data.card import write_card
from petatrain.data.ingest.job import IngestJob, IngestSummary
from petatrain.data.ingest.stages import RESERVED_COLUMNS
from petatrain.data.manifest import Batch, Column, Manifest, Source, Totals, now
from petatrain.data.partitions import hive_partitions, partition_type
from petatrain.errors import PetatrainError
from petatrain.security import signing
from petatrain.storage import read_bytes
from petatrain.storage.checksum import checksum_bytes
from petatrain.storage.fs import SourceFile
from petatrain.storage.lock import Lease


def _describe(f: SourceFile, options) -> dict:
    data = read_bytes(f.url, options)
    try:
        meta = pq.ParquetFile(arrow_reader(data))
    except pa.ArrowException as exc:
        raise PetatrainError(f"--register: {f.url} is not a Parquet file ({exc})") from None
    rows = _rows_held(f.url, meta.metadata)
    return {
        "url": f.url,
        "rows": rows,
        "bytes": len(data),
        "checksum": checksum_bytes(data),
        "sha256": signing.sha256_hex(data) if signing.signs(options) else "",
        "schema": meta.schema_arrow,
        "partitions": hive_partitions(f.url, f.root),
    }


def _rows_held(url: str, footer: pq.FileMetaData) -> int:
    """The rows a file's footer claims, once its row groups bear them out: the total is theirs, and
    every column chunk holds a value (or a null) for each of its group's rows. A footer forged to
    claim 2^62 rows was committed and verified, and the loader then failed on it."""
    groups = [footer.row_group(i) for i in range(footer.num_row_groups)]
    held = sum(g.num_rows for g in groups)
    short = any(
        g.num_rows < 0 or any(g.column(c).num_values < g.num_rows for c in range(g.num_columns)) for g in groups
    )
    if footer.num_rows != held or short:
        raise PetatrainError(
            f"--register: {url}: its footer claims {footer.num_rows} rows, which its row groups do not hold "
            "(a damaged or forged file); nothing was registered"
        )
    return held


def _columns(job: IngestJob, described: list[dict]) -> tuple[list[Column], list[str]]:
    """The dataset's columns (the files' own, then their Hive partitions) and the partition names;
    every file must agree."""
    first = described[0]
    schema, keys = first["schema"], list(first["partitions"])
    for d in described[1:]:
        if not d["schema"].equals(schema):
            raise PetatrainError(f"--register: {d['url']} has schema {d['schema']}, unlike {first['url']}")
        if list(d["partitions"]) != keys:
            raise PetatrainError(
                f"--register: {d['url']} is under the partition folders {list(d['partitions'])}, "
                f"{first['url']} under {keys}; register one partitioned folder at a time"
            )
    clash = [k for k in keys if k in schema.names]
    if clash:
        raise PetatrainError(f"--register: partition folder {clash[0]}=... names a column the files have too")
    reserved = [k for k in keys if k in RESERVED_COLUMNS]
    if reserved:
        raise PetatrainError(
            f"--register: partition folder {reserved[0]}=... takes a name petatrain keeps for its own columns "
            f"({', '.join(RESERVED_COLUMNS)}); rename the partition column"
        )
    if job.config.text_field and job.config.text_field not in schema.names:
        raise PetatrainError(
            f"--register: no column {job.config.text_field!r} in {first['url']} "
            f"(columns: {', '.join(schema.names)}); pass --text-field"
        )
    columns = [Column(f.name, str(f.type)) for f in schema]
    for key in keys:
        columns.append(Column(key, str(partition_type([d["partitions"][key] for d in described]))))
    return columns, keys


def register(
    job: IngestJob, files: list[SourceFile], manifest: Manifest | None, summary: IngestSummary, lease: Lease
) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        described = list(pool.map(lambda f: _describe(f, job.options), files))
    columns, keys = _columns(job, described)
    if manifest and (manifest.schema != columns or manifest.partitions != keys):
        raise PetatrainError(f"--register: new files have schema {columns}, the dataset has {manifest.schema}")

    index = idx.append_shards(job.out, manifest, [{**d, "path": d["url"]} for d in described], job.options)
    summary.files_new = len(files)
    summary.rows_in = summary.rows_out = sum(d["rows"] for d in described)
    summary.shards = len(described)
    summary.bytes = sum(d["bytes"] for d in described)
    before = manifest.totals if manifest else Totals()
    totals = Totals(
        shards=before.shards + summary.shards,
        rows=before.rows + summary.rows_out,
        documents=before.documents + summary.rows_out,
        bytes=before.bytes + summary.bytes,
        rows_in=before.rows_in + summary.rows_in,
    )
    batch = len(manifest.lineage.batches) + 1 if manifest else 1
    history = lineage.extended(
        job.out,
        manifest,
        _sources(files, described, batch),
        Batch(batch=batch, time=now(), files=len(files), rows_out=summary.rows_out),
        job.options,
    )
    _commit(job, manifest, lease, index, columns, keys, totals, history)


def refresh(
    job: IngestJob, files: list[SourceFile], manifest: Manifest | None, summary: IngestSummary, lease: Lease
) -> None:
    """Make the index exactly `files` (see the module docstring); nothing changed commits nothing."""
    if manifest is None:
        return register(job, files, None, summary, lease)
    if not manifest.registered:
        raise PetatrainError(f"{job.out} was ingested, not registered; --refresh re-registers a registered folder")
    known = lineage.read_sources(job.out, manifest, job.options).to_pylist()
    listed = idx.read_shard_index(job.out, manifest, job.options).to_pylist()
    by_url = {s["url"]: s for s in known}
    shard_of = {row["path"]: row for row in listed}
    unchanged = {
        f.url
        for f in files
        if f.url in by_url
        and f.url in shard_of
        and by_url[f.url]["size"] == f.size
        and (not f.fingerprint or by_url[f.url]["fingerprint"] == f.fingerprint)
    }
    current = {f.url for f in files}
    summary.files_removed = sum(1 for u in by_url if u not in current)
    summary.files_changed = sum(1 for f in files if f.url in by_url and f.url not in unchanged)
    summary.files_new = sum(1 for f in files if f.url not in by_url)
    summary.files_already_ingested = len(unchanged)
    if not (summary.files_removed or summary.files_changed or summary.files_new):
        summary.note = "nothing changed: the index already holds exactly the folder's files"
        return None
    read = [f for f in files if f.url not in unchanged]
    with ThreadPoolExecutor(max_workers=8) as pool:
        fresh = {d["url"]: d for d in pool.map(lambda f: _describe(f, job.options), read)}
    described = []
    for f in files:
        if f.url in fresh:
            described.append(fresh[f.url])
        else:
            row = shard_of[f.url]
            described.append({**row, "url": f.url, "partitions": hive_partitions(f.url, f.root), "schema": None})
    columns, keys = _columns(job, list(fresh.values())) if fresh else (manifest.schema, manifest.partitions)
    if unchanged and (columns != manifest.schema or keys != manifest.partitions):
        raise PetatrainError(
            f"--refresh: the new files of {job.out} have schema {columns}; the files kept from before have "
            f"{manifest.schema}. Rewrite the folder whole, or register it into a new --out"
        )
    index = idx.append_shards(job.out, None, [{**d, "path": d["url"]} for d in described], job.options)
    rows = sum(d["rows"] for d in described)
    summary.shards = len(described)
    summary.rows_in = summary.rows_out = sum(d["rows"] for d in fresh.values())
    summary.bytes = sum(d["bytes"] for d in fresh.values())
    summary.note = (
        f"refreshed: {summary.files_new} file(s) added, {summary.files_removed} removed, "
        f"{summary.files_changed} changed, {summary.files_already_ingested} unchanged; {rows} rows now"
    )
    size = sum(d["bytes"] for d in described)
    totals = Totals(shards=len(described), rows=rows, documents=rows, rows_in=rows, bytes=size)
    batch = len(manifest.lineage.batches) + 1
    history = lineage.replaced(
        job.out,
        manifest,
        _sources(files, described, batch),
        Batch(batch=batch, time=now(), files=len(files), rows_out=rows),
        job.options,
    )
    _commit(job, manifest, lease, index, columns, keys, totals, history)
    return None


def _sources(files: list[SourceFile], described: list[dict], batch: int) -> list[Source]:
    return [
        Source(url=f.url, size=f.size, fingerprint=f.fingerprint, checksum=d["checksum"], batch=batch)
        for f, d in zip(files, described, strict=True)
    ]


def _commit(job, manifest, lease, index, columns, keys, totals, history) -> None:
    new_manifest = Manifest(
        created=manifest.created if manifest else now(),
        index=index,
        kind="registered",
        registered=True,
        schema=columns,
        partitions=keys,
        totals=totals,
        ingest={"text_field": job.config.text_field},
        lineage=history,
    )
    lease.check()
    written_record = idx.commit_manifest(job.out, new_manifest, manifest, job.options)
    idx.remove_old_indexes(job.out, new_manifest, manifest, job.options)
    lineage.remove_unused(job.out, new_manifest, manifest, job.options)
    write_card(job.out, new_manifest, job.options)
    commit_log.record(job.out, commit_log.committed(job.out, new_manifest, manifest, written_record), job.options)
