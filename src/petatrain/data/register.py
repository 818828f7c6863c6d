"""`ingest --register`: index existing Parquet files (written by Spark, say) in place.

The files are not rewritten: the shard index records their URLs, row counts, sizes and
checksums, so readers and `inspect --verify` treat them like shards petatrain wrote.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data import index as idx
from petatrain.data.buffers import arrow_reader
from petatrain.data.job import IngestJob, IngestSummary
from petatrain.errors import PetatrainError
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
    return {
        "url": f.url,
        "rows": meta.metadata.num_rows,
        "bytes": len(data),
        "checksum": checksum_bytes(data),
        "schema": meta.schema_arrow,
    }


def register(
    job: IngestJob, files: list[SourceFile], manifest: dict | None, summary: IngestSummary, lease: Lease
) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        described = list(pool.map(lambda f: _describe(f, job.options), files))
    schema = described[0]["schema"]
    for d in described[1:]:
        if not d["schema"].equals(schema):
            raise PetatrainError(f"--register: {d['url']} has schema {d['schema']}, unlike {described[0]['url']}")
    columns = [{"name": f.name, "type": str(f.type)} for f in schema]
    if manifest and manifest["schema"] != columns:
        raise PetatrainError(f"--register: new files have schema {columns}, the dataset has {manifest['schema']}")
    if job.config.text_field and job.config.text_field not in schema.names:
        raise PetatrainError(
            f"--register: no column {job.config.text_field!r} in {described[0]['url']} "
            f"(columns: {', '.join(schema.names)}); pass --text-field"
        )

    index_meta = idx.append_shards(job.out, manifest, [{**d, "path": d["url"]} for d in described], job.options)
    totals = dict(manifest["totals"]) if manifest else idx.empty_totals()
    summary.files_new = len(files)
    summary.rows_in = summary.rows_out = sum(d["rows"] for d in described)
    summary.shards = len(described)
    summary.bytes = sum(d["bytes"] for d in described)
    for key, value in (
        ("shards", summary.shards),
        ("rows", summary.rows_out),
        ("documents", summary.rows_out),
        ("bytes", summary.bytes),
        ("rows_in", summary.rows_in),
    ):
        totals[key] += value
    lineage: dict[str, Any] = manifest["lineage"] if manifest else {"sources": [], "batches": [], "next_file_ord": 0}
    batch = len(lineage["batches"]) + 1
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new_manifest = {
        "created": manifest["created"] if manifest else now,
        "index": index_meta,
        "kind": "registered",
        "registered": True,
        "schema": columns,
        "totals": totals,
        "ingest": {"text_field": job.config.text_field},
        "tokenizer": None,
        "lineage": {
            "sources": lineage["sources"]
            + [
                {
                    "url": f.url,
                    "size": f.size,
                    "fingerprint": f.fingerprint,
                    "checksum": d["checksum"],
                    "batch": batch,
                }
                for f, d in zip(files, described, strict=True)
            ],
            "batches": lineage["batches"]
            + [{"batch": batch, "time": now, "files": len(files), "rows_out": summary.rows_out}],
            "next_file_ord": lineage["next_file_ord"] + len(files),
        },
        "dedup_state": [],
        "rejects": [],
    }
    lease.check()
    idx.commit_manifest(job.out, new_manifest, manifest, job.options)
    idx.remove_old_indexes(job.out, new_manifest, manifest, job.options)
