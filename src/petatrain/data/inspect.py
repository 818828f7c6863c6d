"""`petatrain inspect`: what a dataset holds, and whether its shards still match their checksums."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from petatrain.data import index as idx
from petatrain.data.buffers import arrow_reader
from petatrain.storage import StorageOptions, read_bytes


def describe(
    url: str, *, options: StorageOptions | None = None, verify: bool = False, samples: int = 3
) -> dict[str, Any]:
    dataset = idx.open_dataset(url, options)
    m = dataset.manifest
    totals = m["totals"]
    report: dict[str, Any] = {
        "dataset": url,
        "kind": m.get("kind"),
        "schema": m.get("schema", []),
        "rows": totals["rows"],
        "documents": totals.get("documents", totals["rows"]),
        "shards": totals["shards"],
        "bytes": totals["bytes"],
        "rows_in": totals.get("rows_in", 0),
        "rejected": totals.get("rejected", {}),
        "exact_duplicates": totals.get("exact_duplicates", 0),
        "near_duplicates": totals.get("near_duplicates", 0),
        "tokens": totals.get("tokens", 0),
        "tokenizer": m.get("tokenizer"),
        "sources": len(m["lineage"]["sources"]),
        "updated": m.get("updated"),
        "samples": _samples(dataset, samples) if samples else [],
        "verified": None,
        "problems": [],
    }
    if verify:
        report["problems"] = idx.verify_shards(dataset)
        report["verified"] = not report["problems"]
    return report


def _samples(dataset: idx.Dataset, n: int) -> list[dict[str, Any]]:
    if dataset.shards.num_rows == 0:
        return []
    first = dataset.shards.column("path")[0].as_py()
    try:
        table = pq.read_table(arrow_reader(read_bytes(dataset.shard_url(first), dataset.options))).slice(0, n)
    except Exception as exc:  # inspect must still report on a damaged dataset
        return [{"error": f"cannot read {first}: {exc}"}]
    dtype = np.dtype((dataset.manifest.get("tokenizer") or {}).get("dtype", "uint16"))
    rows = []
    for row in table.to_pylist():
        for key, value in row.items():
            if isinstance(value, bytes):
                tokens = np.frombuffer(value, dtype=dtype)
                row[key] = f"{len(tokens)} tokens: {tokens[:12].tolist()}..."
            elif isinstance(value, str) and len(value) > 200:
                row[key] = value[:200] + "…"
        rows.append(row)
    return rows
