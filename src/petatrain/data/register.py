"""`ingest --register`: index existing Parquet files (written by Spark, say) in place.

The files are not rewritten: the shard index records their URLs, row counts, sizes and
checksums, so readers and `inspect --verify` treat them like shards petatrain wrote.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data import index as idx
from petatrain.data.buffers import arrow_reader
from petatrain.data.job import IngestJob, IngestSummary
from petatrain.data.manifest import Batch, Column, Lineage, Manifest, Source, Totals, now
from petatrain.errors import PetatrainError
from petatrain.storage import read_bytes, signing
from petatrain.storage.checksum import checksum_bytes
from petatrain.storage.fs import SourceFile
from petatrain.storage.lock import Lease


def _describe(f: SourceFile, options) -> dict:
    data = read_bytes(f.url, options)
    try:
        meta = pq.ParquetFile(arrow_reader(data))
    except pa.ArrowException as exc:
        raise PetatrainError(f"--register: {f.url} is not a Parquet file ({exc})") from None
    return {
        "url": f.url,
        "rows": meta.metadata.num_rows,
        "bytes": len(data),
        "checksum": checksum_bytes(data),
        "sha256": signing.sha256_hex(data) if signing.signs(options) else "",
        "schema": meta.schema_arrow,
    }


def register(
    job: IngestJob, files: list[SourceFile], manifest: Manifest | None, summary: IngestSummary, lease: Lease
) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        described = list(pool.map(lambda f: _describe(f, job.options), files))
    schema = described[0]["schema"]
    for d in described[1:]:
        if not d["schema"].equals(schema):
            raise PetatrainError(f"--register: {d['url']} has schema {d['schema']}, unlike {described[0]['url']}")
    columns = [Column(f.name, str(f.type)) for f in schema]
    if manifest and manifest.schema != columns:
        raise PetatrainError(f"--register: new files have schema {columns}, the dataset has {manifest.schema}")
    if job.config.text_field and job.config.text_field not in schema.names:
        raise PetatrainError(
            f"--register: no column {job.config.text_field!r} in {described[0]['url']} "
            f"(columns: {', '.join(schema.names)}); pass --text-field"
        )

    index = idx.append_shards(job.out, manifest, [{**d, "path": d["url"]} for d in described], job.options)
    summary.files_new = len(files)
    summary.rows_in = summary.rows_out = sum(d["rows"] for d in described)
    summary.shards = len(described)
    summary.bytes = sum(d["bytes"] for d in described)
    totals = dataclasses.replace(manifest.totals) if manifest else Totals()
    totals.shards += summary.shards
    totals.rows += summary.rows_out
    totals.documents += summary.rows_out
    totals.bytes += summary.bytes
    totals.rows_in += summary.rows_in
    lineage = manifest.lineage if manifest else Lineage()
    batch = len(lineage.batches) + 1
    sources = [
        Source(url=f.url, size=f.size, fingerprint=f.fingerprint, checksum=d["checksum"], batch=batch)
        for f, d in zip(files, described, strict=True)
    ]
    new_manifest = Manifest(
        created=manifest.created if manifest else now(),
        index=index,
        kind="registered",
        registered=True,
        schema=columns,
        totals=totals,
        ingest={"text_field": job.config.text_field},
        lineage=lineage.extended(sources, Batch(batch=batch, time=now(), files=len(files), rows_out=summary.rows_out)),
    )
    lease.check()
    idx.commit_manifest(job.out, new_manifest, manifest, job.options)
    idx.remove_old_indexes(job.out, new_manifest, manifest, job.options)
