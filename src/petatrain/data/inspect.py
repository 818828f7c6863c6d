"""`petatrain inspect`: what a dataset holds, and whether its shards still match their checksums."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from petatrain.data import index as idx
from petatrain.data.buffers import arrow_reader
from petatrain.data.manifest import Manifest
from petatrain.security.parquet_crypt import open_parquet
from petatrain.storage import StorageOptions, read_bytes


def _source_fields(m: Manifest) -> list[str]:
    """The columns that hold the sources' own fields: all of a registered dataset's, else those
    beside petatrain's (`id` is petatrain's in a dataset from before source fields were kept)."""
    names = [c.name for c in m.schema]
    own = {"doc_id", "text", "tokens", "num_tokens"} | ({"id"} if "doc_id" not in names else set())
    return [n for n in names if m.registered or n not in own]


def describe(
    url: str, *, options: StorageOptions | None = None, verify: bool = False, samples: int = 3
) -> dict[str, Any]:
    dataset = idx.open_dataset(url, options)
    m = dataset.manifest
    totals = m.totals
    report: dict[str, Any] = {
        "dataset": url,
        "kind": m.kind,
        "schema": [dataclasses.asdict(c) for c in m.schema],
        "rows": totals.rows,
        "documents": totals.documents or totals.rows,
        "shards": totals.shards,
        "bytes": totals.bytes,
        "rows_in": totals.rows_in,
        "rejected": totals.rejected,
        "exact_duplicates": totals.exact_duplicates,
        "near_duplicates": totals.near_duplicates,
        "tokens": totals.tokens,
        "tokenizer": dataclasses.asdict(m.tokenizer) if m.tokenizer else None,
        "sources": m.lineage.num_sources,
        # Columns that carry the sources' own fields (and Hive partitions), beside petatrain's.
        "source_fields": _source_fields(m),
        "partitions": list(m.partitions),
        "updated": m.updated,
        "encryption": _encryption(dataset),
        "signature": {"key_id": m.signed_by, "verified": m.signed} if m.signed_by else None,
        "samples": _samples(dataset, samples) if samples else [],
        "verified": None,
        "problems": [],
    }
    report["versions"] = versions(url, options)
    if verify:
        report["problems"] = idx.verify_shards(dataset)
        report["verified"] = not report["problems"]
    return report


def versions(url: str, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """Every kept version of the dataset, oldest first: its number, when it was committed, its rows
    and tokens, and what its commit added (rows, source files) and dropped as duplicates."""
    root = idx.split_version(url)[0]
    listed, before = [], None
    for number in idx.version_numbers(root, options):
        m = idx.read_manifest(idx.versioned(root, number), options)
        if m is None:
            continue
        t = m.totals
        dropped = t.exact_duplicates + t.near_duplicates
        listed.append(
            {
                "version": number,
                "committed": m.updated or m.created,
                "rows": t.rows,
                "tokens": t.tokens,
                "shards": t.shards,
                "sources": m.lineage.num_sources,
                "rows_added": t.rows - (before.totals.rows if before else 0),
                "sources_added": m.lineage.num_sources - (before.lineage.num_sources if before else 0),
                "duplicates_dropped": dropped
                - ((before.totals.exact_duplicates + before.totals.near_duplicates) if before else 0),
            }
        )
        before = m
    return listed


def _encryption(dataset: idx.Dataset) -> dict[str, Any] | None:
    """Which dataset keys encrypt how many shards, and the master key version each is wrapped with."""
    record = dataset.manifest.encryption
    if record is None:
        return None
    keys = dataset.shards.column("key").to_pylist()
    return {
        "algorithm": record.get("algorithm"),
        "keys": {k: {"key_version": v.get("key_version"), "shards": keys.count(k)} for k, v in record["keys"].items()},
        "plaintext_shards": keys.count(""),
    }


def _samples(dataset: idx.Dataset, n: int) -> list[dict[str, Any]]:
    if dataset.shards.num_rows == 0:
        return []
    first = dataset.shards.column("path")[0].as_py()
    try:
        key = dataset.shards.column("key")[0].as_py()
        crypt = idx.dataset_keys(dataset.url, dataset.manifest, dataset.options) if key else None
        source = arrow_reader(read_bytes(dataset.shard_url(first), dataset.options))
        table = open_parquet(source, crypt).read().slice(0, n)
    except Exception as exc:  # inspect must still report on a damaged dataset
        return [{"error": f"cannot read {first}: {exc}"}]
    tokenizer = dataset.manifest.tokenizer
    dtype = np.dtype(tokenizer.dtype if tokenizer else "uint16")
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
