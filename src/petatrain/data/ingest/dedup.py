"""Distributed exact and near deduplication as hash-partitioned map-reduce on Ray tasks.

Input: signature files (one per source file, written by the ingest's first stage and,
for appends, the dataset's dedup state). Output: the documents to drop, with the
reason and the earlier document each one duplicates.

No stage holds all documents or all signatures: map tasks read one signature file and
split its rows by hash into P partitions; reducers see one partition each. Decisions
depend only on document ids (`ord`, which is input order) and content, never on
partitioning or scheduling, so the result is the same with 1 or 100 workers:

- exact: among documents with the same 128-bit content hash, the earliest survives;
- near: documents sharing an LSH band bucket become candidate pairs (each member paired
  with the earliest `MAX_PARTNERS` members of its bucket); a pair is a duplicate when the
  signature estimate of Jaccard similarity reaches the threshold; a document with any
  verified earlier partner is dropped. Documents already committed (ord < first_new)
  are never dropped, so an append dedups new files against the dataset without
  touching it.

Verification needs both signatures of a pair, so the pairs travel through two rounds
keyed by `ord`: the first attaches the earlier document's signature, the second the
later one's and decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from petatrain.data.buffers import arrow_reader
from petatrain.data.ingest.minhash import LSHParams, band_keys
from petatrain.storage import StorageOptions, atomic_write, read_bytes

EXACT, NEAR = 1, 2
REASONS = {EXACT: "exact_duplicate", NEAR: "near_duplicate"}
MAX_PARTNERS = 8  # earliest bucket members each document is compared against
_TARGET_PARTITION_BYTES = 64 << 20

Parts = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class DedupPlan:
    mode: str  # "exact" or "near"
    params: LSHParams | None
    first_new: int  # documents with a smaller ord are committed and never dropped
    partitions: int


def partitions_for(total_rows: int, num_perm: int, cpus: int) -> int:
    per_row = 32 + 2 * num_perm
    return max(2 * cpus, math.ceil(total_rows * per_row / _TARGET_PARTITION_BYTES), 2)


def read_signatures(url: str, options: StorageOptions | None) -> Parts:
    table = pq.ParquetFile(arrow_reader(read_bytes(url, options))).read()
    out = {name: table.column(name).to_numpy() for name in ("ord", "nbytes", "h_hi", "h_lo")}
    if "sig" in table.column_names:
        width = table.schema.field("sig").type.byte_width // 2
        raw = table.column("sig").combine_chunks()
        out["sig"] = np.frombuffer(
            raw.buffers()[1], dtype=np.uint16, count=len(raw) * width, offset=raw.offset * width * 2
        ).reshape(len(raw), width)
    return out


def _split(rows: Parts, key: np.ndarray, n: int) -> list[Parts]:
    bucket = (key % np.uint64(n)).astype(np.int64) if key.dtype == np.uint64 else key % n
    order = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[order], np.arange(n + 1))
    return [{k: v[order[bounds[i] : bounds[i + 1]]] for k, v in rows.items()} for i in range(n)]


def _concat(parts: tuple[Parts, ...]) -> Parts:
    full = [p for p in parts if p and len(next(iter(p.values())))]
    if not full:
        return {}
    return {k: np.concatenate([p[k] for p in full]) for k in full[0]}


def _map(url: str, options: StorageOptions | None, plan: DedupPlan) -> list[Parts]:
    """One signature file -> P exact parts, P band parts, P signature parts."""
    rows = read_signatures(url, options)
    p = plan.partitions
    exact = _split({k: rows[k] for k in ("ord", "nbytes", "h_hi", "h_lo")}, rows["h_lo"], p)
    if plan.mode != "near":
        return exact + [{}] * (2 * p)
    params = plan.params
    assert params is not None, "near dedup has LSH parameters"
    keys = band_keys(rows["sig"], params)  # (n, bands)
    bands = {
        "key": keys.reshape(-1),
        "ord": np.repeat(rows["ord"], params.bands),
        "h_lo": np.repeat(rows["h_lo"], params.bands),
    }
    band_parts = _split(bands, bands["key"], p)
    sig_parts = _split({k: rows[k] for k in ("ord", "nbytes", "sig")}, rows["ord"].astype(np.uint64), p)
    return exact + band_parts + sig_parts


def _reduce_exact(first_new: int, *parts: Parts) -> Parts:
    rows = _concat(parts)
    if not rows:
        return {}
    order = np.lexsort((rows["ord"], rows["h_lo"], rows["h_hi"]))
    hi, lo, ords = rows["h_hi"][order], rows["h_lo"][order], rows["ord"][order]
    same = np.zeros(len(order), dtype=bool)
    same[1:] = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
    run_start = np.maximum.accumulate(np.where(~same, np.arange(len(order)), 0))
    drop = same & (ords >= first_new)
    return {
        "ord": ords[drop],
        "dup_of": ords[run_start][drop],
        "nbytes": rows["nbytes"][order][drop],
        "reason": np.full(int(drop.sum()), EXACT, dtype=np.uint8),
    }


def _reduce_bands(first_new: int, partitions: int, *parts: Parts) -> list[Parts]:
    """Band bucket members -> candidate (later, earlier) pairs, split by earlier's ord."""
    rows = _concat(parts)
    empty: list[Parts] = [{}] * partitions
    if not rows:
        return empty
    # Almost every bucket holds one document: drop those with a hash-based pass (O(n))
    # before sorting, which then touches only the few shared buckets.
    shared = pd.Series(rows["key"]).duplicated(keep=False).to_numpy()
    rows = {k: v[shared] for k, v in rows.items()}
    # Exact copies are the exact pass's business: keep one member per content hash.
    order = np.lexsort((rows["ord"], rows["h_lo"], rows["key"]))
    key, h_lo, ords = rows["key"][order], rows["h_lo"][order], rows["ord"][order]
    first_copy = np.ones(len(order), dtype=bool)
    first_copy[1:] = (key[1:] != key[:-1]) | (h_lo[1:] != h_lo[:-1])
    key, ords = key[first_copy], ords[first_copy]
    # Within a bucket, members in input order: rank 0 is the earliest.
    order = np.lexsort((ords, key))
    key, ords = key[order], ords[order]
    new_run = np.ones(len(key), dtype=bool)
    new_run[1:] = key[1:] != key[:-1]
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(len(key)), 0))
    rank = np.arange(len(key)) - run_start
    later, earlier = [], []
    for k in range(MAX_PARTNERS):
        sel = (rank > k) & (ords >= first_new)
        if not sel.any():
            break
        later.append(ords[sel])
        earlier.append(ords[run_start[sel] + k])
    if not later:
        return empty
    pairs = np.unique(np.stack([np.concatenate(later), np.concatenate(earlier)], axis=1), axis=0)
    out = {"later": pairs[:, 0], "earlier": pairs[:, 1]}
    return _split(out, out["earlier"].astype(np.uint64), partitions)


def _lookup(sig_rows: Parts, wanted: np.ndarray) -> np.ndarray:
    order = np.argsort(sig_rows["ord"])
    pos = np.searchsorted(sig_rows["ord"], wanted, sorter=order)
    return order[pos]


def _attach_earlier(partitions: int, n_sig: int, *parts: Parts) -> list[Parts]:
    sigs, pairs = _concat(parts[:n_sig]), _concat(parts[n_sig:])
    if not pairs:
        return [{}] * partitions
    pairs = {k: v for k, v in pairs.items()}
    idx = _lookup(sigs, pairs["earlier"])
    pairs["sig_earlier"] = sigs["sig"][idx]
    return _split(pairs, pairs["later"].astype(np.uint64), partitions)


def _verify(threshold: float, n_sig: int, *parts: Parts) -> Parts:
    sigs, pairs = _concat(parts[:n_sig]), _concat(parts[n_sig:])
    if not pairs:
        return {}
    idx = _lookup(sigs, pairs["later"])
    similar = (sigs["sig"][idx] == pairs["sig_earlier"]).mean(axis=1) >= threshold
    later, earlier, nbytes = pairs["later"][similar], pairs["earlier"][similar], sigs["nbytes"][idx][similar]
    if not len(later):
        return {}
    order = np.lexsort((earlier, later))
    later, earlier, nbytes = later[order], earlier[order], nbytes[order]
    first = np.ones(len(later), dtype=bool)
    first[1:] = later[1:] != later[:-1]  # keep the earliest verified partner
    return {
        "ord": later[first],
        "dup_of": earlier[first],
        "nbytes": nbytes[first],
        "reason": np.full(int(first.sum()), NEAR, dtype=np.uint8),
    }


def _write_group(url: str, options: StorageOptions | None, file_bits: int, *parts: Parts) -> dict:
    """Drops for one group of source files -> a parquet file and per-file counts."""
    rows = _concat(parts)
    if not rows:
        rows = {
            "ord": np.empty(0, np.int64),
            "dup_of": np.empty(0, np.int64),
            "nbytes": np.empty(0, np.int64),
            "reason": np.empty(0, np.uint8),
        }
    # An ord dropped by both passes counts once, as exact (exact sorts first).
    order = np.lexsort((rows["reason"], rows["ord"]))
    rows = {k: v[order] for k, v in rows.items()}
    first = np.ones(len(rows["ord"]), dtype=bool)
    first[1:] = rows["ord"][1:] != rows["ord"][:-1]
    rows = {k: v[first] for k, v in rows.items()}
    reason = pa.DictionaryArray.from_arrays(
        pa.array(rows["reason"].astype(np.int8) - 1), pa.array([REASONS[EXACT], REASONS[NEAR]])
    )
    table = pa.table({"ord": rows["ord"], "dup_of": rows["dup_of"], "reason": reason, "nbytes": rows["nbytes"]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write(url, sink.getvalue().to_pybytes(), options)
    file_ord = rows["ord"] >> file_bits
    summary: dict[int, dict[str, int]] = {}
    for f in np.unique(file_ord):
        mask = file_ord == f
        summary[int(f)] = {
            "dropped": int(mask.sum()),
            "dropped_bytes": int(rows["nbytes"][mask].sum()),
            "exact": int((rows["reason"][mask] == EXACT).sum()),
            "near": int((rows["reason"][mask] == NEAR).sum()),
        }
    return summary


def find_duplicates(
    signature_urls: list[str],
    plan: DedupPlan,
    *,
    groups_url: str,
    num_groups: int,
    file_bits: int,
    options: StorageOptions | None,
    progress=None,
) -> dict[int, dict]:
    """Run exact (and near) dedup over the signature files; write the drops grouped by
    source file (`groups_url/g-XXXXX.parquet`, group = file ord % num_groups) and return
    per-file drop counts."""
    p = plan.partitions
    # Ray returns a bare object, not a list, for num_returns=1: keep every fan-out >= 2.
    assert p >= 2 and num_groups >= 2, "partitions and groups must be >= 2"
    task = ray.remote(num_cpus=1)
    map_task = task(_map).options(num_returns=3 * p)
    exact_task, bands_task = task(_reduce_exact), task(_reduce_bands).options(num_returns=p)
    attach_task, verify_task = task(_attach_earlier).options(num_returns=p), task(_verify)
    split_task, write_task = task(_split_drops).options(num_returns=num_groups), task(_write_group)

    # With num_returns > 1 a call returns a list of refs, one per output.
    mapped: list[Any] = [map_task.remote(url, options, plan) for url in signature_urls]
    if not mapped:
        return {}
    drop_refs = [exact_task.remote(plan.first_new, *[m[i] for m in mapped]) for i in range(p)]
    if plan.mode == "near":
        assert plan.params is not None, "near dedup has LSH parameters"
        threshold = plan.params.threshold
        sigs = [[m[2 * p + i] for m in mapped] for i in range(p)]
        bands: list[Any] = [bands_task.remote(plan.first_new, p, *[m[p + i] for m in mapped]) for i in range(p)]
        attached: list[Any] = [attach_task.remote(p, len(sigs[i]), *sigs[i], *[b[i] for b in bands]) for i in range(p)]
        drop_refs += [
            verify_task.remote(threshold, len(sigs[i]), *sigs[i], *[a[i] for a in attached]) for i in range(p)
        ]
    by_group: list[Any] = [split_task.remote(ref, num_groups, file_bits) for ref in drop_refs]
    writes = [
        write_task.remote(f"{groups_url}/g-{g:05d}.parquet", options, file_bits, *[b[g] for b in by_group])
        for g in range(num_groups)
    ]
    summary: dict[int, dict] = {}
    pending = list(writes)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        summary.update(ray.get(done[0]))
        if progress:
            progress(len(writes) - len(pending), len(writes))
    return summary


def _split_drops(rows: Parts, num_groups: int, file_bits: int) -> list[Parts]:
    if not rows:
        return [{}] * num_groups
    return _split(rows, (rows["ord"] >> file_bits) % num_groups, num_groups)
