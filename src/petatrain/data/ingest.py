"""`petatrain ingest`: raw files -> a clean, deduplicated, sharded dataset, on Ray Data.

Stages, each distributed and each writing to a staging folder inside the dataset:

1. read + clean + sign (Ray Data, one task per source file): parse, quarantine bad
   records to rejects, NFC-normalise, hash for exact dedup and MinHash for near dedup.
2. dedup (Ray tasks, hash-partitioned map-reduce, see `dedup.py`): which documents to
   drop, deterministic "earliest in input order wins".
3. shard plan (driver, per-file counts only): contiguous runs of documents in input
   order, about `shard_size` bytes each.
4. write (Ray Data, one task per shard): filter drops, optionally tokenise and pack,
   write Parquet shards and the dedup state an `--append` will compare against.
5. commit (driver): move rejects and state into place, extend the shard index, and
   write the manifest last. Before that, the dataset is what it was.

A document's id (`ord`) is `file_ord << FILE_BITS | record number`: input order, which
makes every decision independent of how many workers ran.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from petatrain.config import IngestConfig, parse_size
from petatrain.data import clean as cleaning
from petatrain.data import dedup as dedup_mod
from petatrain.data import index as idx
from petatrain.data import sources as src
from petatrain.data import tokenize as tk
from petatrain.data.buffers import arrow_reader
from petatrain.data.minhash import LSHParams, signatures
from petatrain.errors import PetatrainError
from petatrain.runtime.cluster import init_ray
from petatrain.storage import StorageOptions, atomic_write, join, listdir, read_bytes, remove_tree
from petatrain.storage.checksum import checksum_bytes
from petatrain.storage.fs import SourceFile, copy, expand_sources, resolve
from petatrain.storage.lock import Lease
from petatrain.storage.retry import retrying

log = logging.getLogger(__name__)

FILE_BITS = 36  # records per file < 2^36; files per dataset < 2^27
_STAGED_ROW_GROUP = 4096
_SHARD_ROW_GROUP = 4096
_SIGN_CHUNK = 2048  # documents per MinHash batch (bounds the (perms, shingles) block)
_TOKENIZER_SAMPLE_BYTES = 32 << 20
# Settings that must match between an ingest and the append that extends it.
_FIXED_SETTINGS = ("text_field", "dedup", "near_threshold", "tokenizer", "pack_length", "max_chars", "min_chars")


@dataclass(kw_only=True)
class IngestSummary:
    """What one `petatrain ingest` did; `--json` prints this."""

    dataset: str
    rows_in: int = 0
    rows_out: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    exact_duplicates: int = 0
    near_duplicates: int = 0
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    input_bytes: int = 0
    files_new: int = 0
    files_already_ingested: int = 0
    tokens: int = 0
    tokens_left_over: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class IngestJob:
    sources: list[str]
    out: str
    config: IngestConfig = field(default_factory=IngestConfig)
    append: bool = False
    register: bool = False
    address: str = ""
    local_cpus: int = 0  # CPUs of a local Ray started for this job (0: all)
    options: StorageOptions | None = None


def run(job: IngestJob) -> IngestSummary:
    """Ingest `job.sources` into the dataset at `job.out`; see the module docstring."""
    started = time.perf_counter()
    job = replace(job, options=(job.options or StorageOptions()).for_workers())
    options = job.options
    summary = IngestSummary(dataset=job.out)
    files = expand_sources(job.sources, options)
    if idx.read_manifest(job.out, options) is None:
        idx.claim_folder(job.out, options)
    # One writer at a time: what it reads from here to its commit cannot change under it.
    with Lease(join(job.out, idx.LOCK), kind="ingest", what=job.out, options=options) as lease:
        manifest = idx.read_manifest(job.out, options)
        new_files = _new_files(files, manifest, job, summary)
        if not new_files:
            summary.note = "nothing new to ingest: every source is already in the dataset"
        elif job.register:
            from petatrain.data.register import register

            register(job, new_files, manifest, summary, lease)
        else:
            if manifest is None:
                idx.mark_created(job.out, options)
            _ingest(job, new_files, manifest, summary, lease)
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _new_files(
    files: list[SourceFile], manifest: dict | None, job: IngestJob, summary: IngestSummary
) -> list[SourceFile]:
    """Sources not yet in the dataset; refuses changed sources and mismatched settings."""
    if manifest is None:
        return files
    if bool(manifest.get("registered")) != job.register:
        kind = "registered (--register)" if manifest.get("registered") else "ingested (not --register)"
        raise PetatrainError(f"{job.out} was {kind}; use the same mode to extend it")
    if not job.register:
        stored = manifest["ingest"]
        for key in _FIXED_SETTINGS:
            ours = getattr(job.config, key)
            if stored.get(key) != ours:
                raise PetatrainError(
                    f"{job.out} was ingested with {key}={stored.get(key)!r}; this run has {key}={ours!r}. "
                    f"Use the same setting or a new --out"
                )
    known = {s["url"]: s for s in manifest["lineage"]["sources"]}
    fresh = []
    for f in files:
        seen = known.get(f.url)
        if seen is None:
            fresh.append(f)
        elif seen["size"] != f.size or (
            seen.get("fingerprint") and f.fingerprint and seen["fingerprint"] != f.fingerprint
        ):
            raise PetatrainError(
                f"source {f.url} changed since it was ingested "
                f"(size {seen['size']} -> {f.size}); ingest it under a new name"
            )
    summary.files_already_ingested = len(files) - len(fresh)
    if fresh and not job.append:
        raise PetatrainError(
            f"a dataset already exists at {job.out}; pass --append to add the "
            f"{len(fresh)} new source file(s), or choose another --out"
        )
    return fresh


def _ingest(
    job: IngestJob, files: list[SourceFile], manifest: dict | None, summary: IngestSummary, lease: Lease
) -> None:
    import ray

    cfg, options = job.config, job.options
    with _stage("ray_init", summary.stage_seconds):
        init_ray(job.address, job.local_cpus)
    staging = join(job.out, "_staging", uuid.uuid4().hex[:12])
    remove_tree(join(job.out, "_staging"), options)  # a crashed run's; never committed, and we hold the lease
    batch = len(manifest["lineage"]["batches"]) + 1 if manifest else 1
    first_file = manifest["lineage"]["next_file_ord"] if manifest else 0
    if first_file + len(files) >= 1 << (63 - FILE_BITS):
        raise PetatrainError("too many source files for one dataset")
    lsh = LSHParams.for_threshold(cfg.near_threshold) if cfg.dedup == "near" else None
    summary.files_new = len(files)

    # 1. read, clean, sign
    items = [{"file_ord": first_file + i, "url": f.url, "size": f.size} for i, f in enumerate(files)]
    stage_one = _StageOne(staging=staging, cfg=cfg, options=options, lsh=lsh)
    with _stage("read_clean_sign", summary.stage_seconds):
        file_stats = sorted(_from_items(items).map(stage_one, num_cpus=1).take_all(), key=lambda r: r["file_ord"])
    for stat in file_stats:
        summary.rows_in += stat["rows_in"]
        summary.input_bytes += stat["size"]
        for reason, n in json.loads(stat["rejects"]).items():
            summary.rejected[reason] = summary.rejected.get(reason, 0) + n

    # 2. dedup
    num_groups = max(2, min(len(files), 256))
    drops: dict[int, dict] = {}
    if cfg.dedup != "none":
        state_urls = [join(job.out, s["path"]) for s in (manifest or {}).get("dedup_state", [])]
        sig_urls = state_urls + [join(staging, "sigs", f"f-{s['file_ord']:08d}.parquet") for s in file_stats]
        total = sum(s["kept"] for s in file_stats) + (manifest["totals"]["rows"] if manifest else 0)
        plan = dedup_mod.DedupPlan(
            mode=cfg.dedup,
            params=lsh,
            first_new=first_file << FILE_BITS,
            partitions=dedup_mod.partitions_for(
                total, lsh.num_perm if lsh else 0, int(ray.cluster_resources().get("CPU", 1))
            ),
        )
        log.info("dedup: %d signature files, %d partitions", len(sig_urls), plan.partitions)
        with _stage("dedup", summary.stage_seconds):
            drops = dedup_mod.find_duplicates(
                sig_urls,
                plan,
                groups_url=join(staging, "dups"),
                num_groups=num_groups,
                file_bits=FILE_BITS,
                options=options,
                progress=_progress("dedup"),
            )
        summary.exact_duplicates = sum(d["exact"] for d in drops.values())
        summary.near_duplicates = sum(d["near"] for d in drops.values())

    # 3. tokenizer (trained on the leading documents, so the result is deterministic)
    tokenizer_json = None
    if cfg.tokenizer:
        with _stage("tokenizer", summary.stage_seconds):
            tokenizer_json = _tokenizer(job, manifest, staging, file_stats)

    # 4. shard plan and write (into the dataset's own folder: only while the lease is ours)
    lease.check()
    shard_no = manifest["totals"]["shards"] if manifest else 0
    plan_specs = plan_shards(file_stats, drops, parse_size(cfg.shard_size), first_shard=shard_no)
    writer = _ShardWriter(
        out=job.out,
        staging=staging,
        cfg=cfg,
        options=options,
        num_groups=num_groups,
        tokenizer_json=tokenizer_json,
        batch=batch,
        keep_state=cfg.dedup != "none",
    )
    with _stage("write", summary.stage_seconds):
        written = sorted(
            _from_items(plan_specs).map(writer, num_cpus=1).take_all() if plan_specs else [], key=lambda r: r["shard"]
        )

    # 5. commit
    with _stage("commit", summary.stage_seconds):
        new_manifest = _commit(
            job, manifest, files, file_stats, written, staging, batch, first_file, lsh, tokenizer_json, summary
        )
        lease.check()
        idx.commit_manifest(job.out, new_manifest, manifest, options)
        idx.remove_old_indexes(job.out, new_manifest, manifest, options)
        remove_tree(staging, options)


@contextlib.contextmanager
def _stage(name: str, timings: dict[str, float]):
    """Time one stage; the summary reports them so a slow stage is visible."""
    log.info("ingest: %s ...", name)
    started = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - started, 3)
    log.info("ingest: %s done in %.2fs", name, timings[name])


def _progress(name: str) -> Callable[[int, int], None]:
    """A progress callback for stages that run as plain Ray tasks (Ray Data draws its own)."""
    if sys.stderr.isatty():
        from rich.progress import Progress

        bar = Progress(transient=True)
        task = bar.add_task(name, total=None)

        def update(done: int, total: int) -> None:
            if not bar.live.is_started:
                bar.start()
            bar.update(task, completed=done, total=total)
            if done == total:
                bar.stop()

        return update
    return lambda done, total: log.info("%s: %d/%d", name, done, total)


def _from_items(items: list[dict]):
    import ray
    from ray.data import DataContext

    # Each stage is a single map over files or shards, so there is no downstream operator
    # to reserve CPUs for; the reservation left half of a 2-core machine idle (measured:
    # 8.8 s with it, 6.3 s without, for 311 MB).
    DataContext.get_current().op_resource_reservation_enabled = False
    return ray.data.from_items(items, override_num_blocks=max(1, len(items)))


class _StageOne:
    """Ray Data task body: one source file -> staged docs, signatures and rejects."""

    def __init__(self, *, staging: str, cfg: IngestConfig, options: StorageOptions | None, lsh: LSHParams | None):
        self.staging, self.cfg, self.options, self.lsh = staging, cfg, options, lsh

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        url, file_ord = item["url"], int(item["file_ord"])
        records, checksum, size = self._read(url)
        records = cleaning.clean(records, min_chars=self.cfg.min_chars, max_chars=self.cfg.max_chars)
        ords = (np.int64(file_ord) << np.int64(FILE_BITS)) | np.asarray(records.index, dtype=np.int64)
        encoded = [t.encode("utf-8") for t in records.text]
        nbytes = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        name = f"f-{file_ord:08d}.parquet"
        docs = pa.table({"ord": ords, "text": pa.array(records.text, pa.large_string())})
        _write_parquet(join(self.staging, "docs", name), docs, self.options, row_group_size=_STAGED_ROW_GROUP)
        if self.cfg.dedup != "none":
            digests = [xxhash.xxh3_128_intdigest(b) for b in encoded]
            columns = {
                "ord": ords,
                "nbytes": nbytes,
                "h_hi": np.fromiter((d >> 64 for d in digests), dtype=np.uint64, count=len(digests)),
                "h_lo": np.fromiter((d & 0xFFFFFFFFFFFFFFFF for d in digests), dtype=np.uint64, count=len(digests)),
            }
            if self.lsh is not None:
                columns["sig"] = _sign(docs.column("text"), self.lsh)
            _write_parquet(
                join(self.staging, "sigs", name), pa.table(columns), self.options, row_group_size=_STAGED_ROW_GROUP
            )
        reasons = Counter(r.reason for r in records.rejects)
        if records.rejects:
            rejects = pa.table(
                {
                    "source": [url] * len(records.rejects),
                    "record": [r.index for r in records.rejects],
                    "reason": [r.reason for r in records.rejects],
                    "detail": [r.detail for r in records.rejects],
                    "raw": pa.array([r.raw for r in records.rejects], pa.large_binary()),
                }
            )
            _write_parquet(join(self.staging, "rejects", name), rejects, self.options)
        return {
            "file_ord": file_ord,
            "url": url,
            "checksum": checksum,
            "size": size,
            "rows_in": len(records.index) + len(records.rejects),
            "kept": len(records.index),
            "kept_bytes": int(nbytes.sum()),
            "rejects": json.dumps(dict(reasons)),
        }

    def _read(self, url: str) -> tuple[src.FileRecords, str, int]:
        try:
            data = read_bytes(url, self.options)
        except FileNotFoundError:
            raise PetatrainError(f"source disappeared during the ingest: {url}") from None
        except PermissionError as exc:
            raise PetatrainError(f"source not readable: {url} ({exc})") from None
        checksum, size = checksum_bytes(data), len(data)
        try:
            fmt = self.cfg.format if self.cfg.format != "auto" else src.detect_format(url)
            data = src.decompress(url, data)
        except Exception as exc:
            records = src.FileRecords()
            records.reject(0, "unreadable_file", f"{type(exc).__name__}: {exc}"[:500])
            return records, checksum, size
        records = src.read_file(url, data, fmt, self.cfg.text_field, max_chars=self.cfg.max_chars)
        return records, checksum, size


def _sign(texts: pa.ChunkedArray, lsh: LSHParams) -> pa.Array:
    """MinHash signatures as fixed_size_binary(2 * num_perm), computed in chunks."""
    flat = texts.combine_chunks()
    parts = [signatures(flat.slice(i, _SIGN_CHUNK), lsh) for i in range(0, len(flat), _SIGN_CHUNK)]
    sig = np.concatenate(parts) if parts else np.empty((0, lsh.num_perm), np.uint16)
    width = sig.itemsize * lsh.num_perm
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), len(sig), [None, pa.py_buffer(np.ascontiguousarray(sig).tobytes())]
    )


def _write_parquet(url: str, table: pa.Table, options: StorageOptions | None, **kwargs) -> tuple[str, int]:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **kwargs)
    return atomic_write(url, sink.getvalue().to_pybytes(), options)


def _read_parquet(url: str, options: StorageOptions | None) -> pq.ParquetFile:
    return pq.ParquetFile(arrow_reader(read_bytes(url, options)))


def plan_shards(file_stats: list[dict], drops: dict[int, dict], shard_bytes: int, *, first_shard: int) -> list[dict]:
    """Cut the documents, in input order, into shards of about `shard_bytes` kept bytes.

    Segments are ranges of staged rows of one file; a file's kept bytes per staged row
    is its average, so the plan needs per-file counts only.
    """
    specs: list[dict] = []
    segments: list[list[int]] = []
    budget = float(shard_bytes)
    for stat in file_stats:
        staged, kept_bytes = stat["kept"], stat["kept_bytes"]
        if staged == 0:
            continue
        dropped = drops.get(stat["file_ord"], {})
        kept_bytes -= dropped.get("dropped_bytes", 0)
        if staged - dropped.get("dropped", 0) == 0:
            continue
        per_row = max(kept_bytes / staged, 1e-9)
        start = 0
        while start < staged:
            take = min(staged - start, max(1, math.ceil(budget / per_row)))
            segments.append([stat["file_ord"], start, start + take])
            budget -= take * per_row
            start += take
            if budget <= 0:
                specs.append({"shard": first_shard + len(specs), "segments": json.dumps(segments)})
                segments, budget = [], float(shard_bytes)
    if segments:
        specs.append({"shard": first_shard + len(specs), "segments": json.dumps(segments)})
    return specs


class _ShardWriter:
    """Ray Data task body: one shard spec -> a Parquet shard (+ its dedup state)."""

    def __init__(
        self,
        *,
        out: str,
        staging: str,
        cfg: IngestConfig,
        options: StorageOptions | None,
        num_groups: int,
        tokenizer_json: str | None,
        batch: int,
        keep_state: bool,
    ):
        self.out, self.staging, self.cfg, self.options = out, staging, cfg, options
        self.num_groups, self.tokenizer_json, self.batch, self.keep_state = (
            num_groups,
            tokenizer_json,
            batch,
            keep_state,
        )
        self._tokenizer = None
        self._byte_table = None
        self._groups: dict[int, np.ndarray] = {}

    def __call__(self, spec: dict[str, Any]) -> dict[str, Any]:
        shard = int(spec["shard"])
        ords, texts, state = [], [], []
        for file_ord, start, end in json.loads(spec["segments"]):
            docs = self._rows(file_ord, start, end, "docs")
            ords_here = docs.column("ord").to_numpy()
            keep = (
                ~np.isin(ords_here, self._drops(file_ord))
                if self.cfg.dedup != "none"
                else np.ones(len(ords_here), dtype=bool)
            )
            ords.append(ords_here[keep])
            texts.append(docs.column("text").filter(pa.array(keep)))
            if self.keep_state:  # staged signatures are row-aligned with staged docs
                state.append(self._rows(file_ord, start, end, "sigs").filter(pa.array(keep)))
        ord_arr = np.concatenate(ords)
        text_arr = pa.chunked_array([c for t in texts for c in t.chunks], pa.large_string())
        table, tokens, left_over = self._table(ord_arr, text_arr)
        path = f"data/part-{shard:06d}.parquet"
        checksum, size = _write_parquet(join(self.out, path), table, self.options, **_shard_layout(table))
        result = {
            "shard": shard,
            "path": path,
            "rows": table.num_rows,
            "bytes": size,
            "checksum": checksum,
            "docs": len(ord_arr),
            "tokens": tokens,
            "left_over": left_over,
            "state": "",
            "state_checksum": "",
        }
        if self.keep_state and state:
            state_path = f"_index/dedup/b{self.batch:06d}-part-{shard:06d}.parquet"
            result["state_checksum"], _ = _write_parquet(
                join(self.staging, "state", os.path.basename(state_path)), pa.concat_tables(state), self.options
            )
            result["state"] = state_path
        return result

    def _rows(self, file_ord: int, start: int, end: int, kind: str) -> pa.Table:
        """Rows [start, end) of a staged file, reading only the row groups that hold them
        (a large file is split over several shards; no shard reads all of it)."""
        url = join(self.staging, kind, f"f-{file_ord:08d}.parquet")
        fs, path = resolve(url, self.options)

        def read() -> pa.Table:
            with fs.open(path, "rb") as handle:
                parquet = pq.ParquetFile(handle)
                groups, first, offset = [], None, 0
                for g in range(parquet.num_row_groups):
                    n = parquet.metadata.row_group(g).num_rows
                    if offset + n > start and offset < end:
                        groups.append(g)
                        first = offset if first is None else first
                    offset += n
                return parquet.read_row_groups(groups).slice(start - first, end - start)

        return retrying(f"read {url}", read)

    def _drops(self, file_ord: int) -> np.ndarray:
        """Ords of this file's documents that dedup dropped (each group file read once)."""
        group = file_ord % self.num_groups
        if group not in self._groups:
            url = join(self.staging, "dups", f"g-{group:05d}.parquet")
            table = pq.ParquetFile(arrow_reader(read_bytes(url, self.options))).read(columns=["ord"])
            self._groups[group] = table.column("ord").to_numpy()
        ords = self._groups[group]
        return ords[(ords >> FILE_BITS) == file_ord]

    def _table(self, ords: np.ndarray, texts: pa.ChunkedArray) -> tuple[pa.Table, int, int]:
        if not self.tokenizer_json:
            return pa.table({"id": ords, "text": texts}), 0, 0
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
            self._byte_table = tk.byte_table(self._tokenizer)
        tok = self._tokenizer
        dtype = tk.token_dtype(tok)
        encoded = tk.encode(tok, texts.to_pylist(), self._byte_table)
        tokens = int(sum(len(e) for e in encoded))
        if self.cfg.pack_length:
            rows, left = tk.pack(encoded, self.cfg.pack_length, tk.eos_id(tok), dtype)
            width = self.cfg.pack_length * dtype.itemsize
            column = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(width), len(rows), [None, pa.py_buffer(rows.tobytes())]
            )
            schema = pa.schema([pa.field("tokens", column.type, nullable=False)])
            return pa.table([column], schema=schema), tokens, left
        column = pa.array([e.tobytes() for e in encoded], pa.large_binary())
        return (
            pa.table(
                {
                    "id": ords,
                    "text": texts,
                    "tokens": column,
                    "num_tokens": pa.array([len(e) for e in encoded], pa.int32()),
                }
            ),
            tokens,
            0,
        )


def _shard_layout(table: pa.Table) -> dict[str, Any]:
    """Parquet settings for a shard.

    Token columns are stored so that reading them costs what the bytes cost: no
    compression, no dictionary, no statistics. A packed shard (one required
    fixed-width `tokens` column) is one row group holding one data page, so its values
    are a single contiguous run of bytes in the file that a loader can map without
    decoding (`stream._zero_copy_view`); any Parquet reader still reads it normally.
    Text is zstd-compressed in row groups of 4096 rows.
    """
    layout: dict[str, Any] = {
        "row_group_size": _SHARD_ROW_GROUP,
        "compression": {name: ("none" if name == "tokens" else "zstd") for name in table.column_names},
        "use_dictionary": [name for name in table.column_names if name != "tokens"],
        "write_statistics": [name for name in table.column_names if name != "tokens"],
    }
    if table.column_names == ["tokens"] and pa.types.is_fixed_size_binary(table.schema.field("tokens").type):
        rows = max(1, table.num_rows)
        layout.update(row_group_size=rows, data_page_size=(1 << 31) - 1, max_rows_per_page=rows)
    return layout


def _tokenizer(job: IngestJob, manifest: dict | None, staging: str, file_stats: list[dict]) -> str:
    """The dataset's tokenizer as JSON: the committed one for appends, else built now."""
    if manifest and manifest.get("tokenizer"):
        meta = manifest["tokenizer"]
        return read_bytes(join(job.out, meta["path"]), job.options).decode()
    sample: list[str] = []
    if job.config.tokenizer.startswith("train:"):
        budget = _TOKENIZER_SAMPLE_BYTES
        for stat in file_stats:
            if budget <= 0 or not stat["kept"]:
                continue
            docs = _read_parquet(join(staging, "docs", f"f-{stat['file_ord']:08d}.parquet"), job.options).read(
                columns=["text"]
            )
            for text in docs.column("text").to_pylist():
                sample.append(text)
                budget -= len(text)
                if budget <= 0:
                    break
    tok = tk.load(job.config.tokenizer, sample)
    tk.eos_id(tok)
    return tok.to_str()


def _commit(
    job: IngestJob,
    manifest: dict | None,
    files: list[SourceFile],
    file_stats: list[dict],
    written: list[dict],
    staging: str,
    batch: int,
    first_file: int,
    lsh: LSHParams | None,
    tokenizer_json: str | None,
    summary: IngestSummary,
) -> dict[str, Any]:
    """Move this batch's rejects, dedup state and tokenizer into place, extend the shard index,
    and return the manifest that commits them (the caller publishes it)."""
    out, options = job.out, job.options
    # Rejects and duplicate records of this batch, then dedup state and tokenizer.
    rejects = [] if manifest is None else list(manifest.get("rejects", []))
    for kind in ("rejects", "dups"):
        for url in listdir(join(staging, kind), options):
            name = f"{'records' if kind == 'rejects' else 'duplicates'}-{os.path.basename(url)}"
            target = f"_rejects/batch-{batch:06d}/{name}"
            copy(url, join(out, target), options)
            rejects.append({"path": target, "batch": batch})
    state = [] if manifest is None else list(manifest.get("dedup_state", []))
    for w in written:
        if w["state"]:
            copy(join(staging, "state", os.path.basename(w["state"])), join(out, w["state"]), options)
            state.append({"path": w["state"], "checksum": w["state_checksum"]})
    tokenizer_meta = manifest.get("tokenizer") if manifest else None
    if tokenizer_json and tokenizer_meta is None:
        checksum, _ = atomic_write(join(out, "_index/tokenizer.json"), tokenizer_json.encode(), options)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer_json)
        tokenizer_meta = {
            "path": "_index/tokenizer.json",
            "checksum": checksum,
            "spec": job.config.tokenizer,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "eos_id": tk.eos_id(tok),
            "dtype": tk.token_dtype(tok).name,
        }

    index_meta = idx.append_shards(out, manifest, written, options)
    schema = _schema_of(out, written, options) if written else (manifest or {}).get("schema", [])
    totals = dict(manifest["totals"]) if manifest else idx.empty_totals()
    summary.rows_out = sum(w["rows"] for w in written)
    summary.shards = len(written)
    summary.bytes = sum(w["bytes"] for w in written)
    summary.tokens = sum(w["tokens"] for w in written)
    summary.tokens_left_over = sum(w["left_over"] for w in written)
    totals["shards"] += len(written)
    totals["rows"] += summary.rows_out
    totals["bytes"] += summary.bytes
    totals["documents"] += sum(w["docs"] for w in written)
    totals["rows_in"] += summary.rows_in
    totals["exact_duplicates"] += summary.exact_duplicates
    totals["near_duplicates"] += summary.near_duplicates
    totals["tokens"] += summary.tokens
    merged = Counter(totals["rejected"])
    merged.update(summary.rejected)
    totals["rejected"] = dict(merged)

    stats = {s["file_ord"]: s for s in file_stats}
    lineage = manifest["lineage"] if manifest else {"sources": [], "batches": [], "next_file_ord": 0}
    lineage = {
        "sources": lineage["sources"]
        + [
            {
                "url": f.url,
                "size": f.size,
                "fingerprint": f.fingerprint,
                "checksum": stats[first_file + i]["checksum"],
                "file_ord": first_file + i,
                "batch": batch,
            }
            for i, f in enumerate(files)
        ],
        "batches": lineage["batches"]
        + [
            {
                "batch": batch,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": len(files),
                "rows_out": summary.rows_out,
            }
        ],
        "next_file_ord": first_file + len(files),
    }
    new_manifest = {
        "created": manifest["created"] if manifest else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kind": "packed" if job.config.pack_length else "tokens" if job.config.tokenizer else "text",
        "schema": schema,
        "totals": totals,
        "index": index_meta,
        "ingest": {
            **asdict(job.config),
            **({"num_perm": lsh.num_perm, "bands": lsh.bands, "rows": lsh.rows, "ngram": lsh.ngram} if lsh else {}),
        },
        "file_bits": FILE_BITS,
        "tokenizer": tokenizer_meta,
        "lineage": lineage,
        "dedup_state": state,
        "rejects": rejects,
        "registered": False,
    }
    return new_manifest


def _schema_of(out: str, written: list[dict], options: StorageOptions | None) -> list[dict[str, str]]:
    fs, path = resolve(join(out, written[0]["path"]), options)
    with fs.open(path, "rb") as handle:
        schema = pq.read_schema(handle)
    return [{"name": f.name, "type": str(f.type)} for f in schema]
