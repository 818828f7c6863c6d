"""`petatrain ingest`: raw files -> a clean, deduplicated, sharded dataset, on Ray tasks.

Stages, each distributed and each writing to a staging folder inside the dataset:

1. read + clean + sign (a Ray task per source file, or per piece of a file over
   `split_size`, see `split.py`): parse, quarantine bad records to rejects, NFC-normalise,
   hash for exact dedup and MinHash for near dedup.
2. dedup (Ray tasks, hash-partitioned map-reduce, see `dedup.py`): which documents to
   drop, deterministic "earliest in input order wins".
3. shard plan (driver, per-file counts only): contiguous runs of documents in input
   order, about `shard_size` bytes each.
4. write (a Ray task per shard): filter drops, optionally tokenise and pack,
   write Parquet shards and the dedup state an `--append` will compare against.
5. commit (driver): move rejects and state into place, extend the shard index, and
   write the manifest last. Before that, the dataset is what it was.

A document's id (`ord`, the shards' `doc_id`) is `file_ord << FILE_BITS | record number`:
input order, which makes every decision independent of how many workers ran. The sources'
other fields ride along as columns (`--fields`, `--drop-fields`), their own `id` included.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from petatrain import constants
from petatrain.config import parse_size
from petatrain.data import commit_log, lineage
from petatrain.data import index as idx
from petatrain.data.card import write_card
from petatrain.data.ingest import dedup as dedup_mod
from petatrain.data.ingest import split
from petatrain.data.ingest import tokenize as tk
from petatrain.data.ingest.job import IngestJob, IngestSummary, StageProgress
from petatrain.data.ingest.minhash import LSHParams
from petatrain.data.ingest.register import refresh, register
from petatrain.data.ingest.stages import (
    FILE_BITS,
    RESERVED_COLUMNS,
    ReadCleanSign,
    ShardWriter,
    plan_shards,
    read_parquet,
    split_field_types,
    staged_name,
    unify_fields,
    whole_file,
)
from petatrain.data.manifest import Batch, Column, Manifest, Source, TokenizerInfo, Totals, now
from petatrain.data.partitions import hive_partitions
from petatrain.data.readers import FieldChoice
from petatrain.errors import PetatrainError
from petatrain.security import parquet_crypt
from petatrain.security.parquet_crypt import DatasetKeys, open_parquet
from petatrain.security.protection import protection_of
from petatrain.storage import (
    StorageOptions,
    atomic_write,
    exists,
    join,
    listdir,
    read_verified,
    remove_tree,
)
from petatrain.storage.checksum import ChecksumMismatch
from petatrain.storage.fs import SourceFile, copy, expand_sources, read_range, resolve, unchanged
from petatrain.storage.lock import LEASE_FILE, Lease

log = logging.getLogger(__name__)

_TOKENIZER_SAMPLE_BYTES = 32 << 20
# Settings that must match between an ingest and the append that extends it.
_FIXED_SETTINGS = (
    "text_field",
    "dedup",
    "near_threshold",
    "tokenizer",
    "pack_length",
    "max_chars",
    "min_chars",
    "fields",
    "drop_fields",
)
_FIELD_SETTINGS = ("fields", "drop_fields")  # not recorded by datasets written before fields were kept


def run(job: IngestJob) -> IngestSummary:
    """Ingest `job.sources` into the dataset at `job.out`; see the module docstring."""
    started = time.perf_counter()
    job = replace(job, options=(job.options or StorageOptions()).for_workers())
    options = job.options
    summary = IngestSummary(dataset=job.out)
    if job.refresh and not job.register:
        raise PetatrainError("--refresh re-registers a folder of Parquet files: use it with --register")
    if job.register and (job.config.fields.strip() != "*" or job.config.drop_fields.strip()):
        raise PetatrainError(
            "--register indexes the files as they are, every column included; --fields and --drop-fields choose "
            "what an ingest writes (a reader picks columns: loader(..., columns=[...]))"
        )
    files = expand_sources(job.sources, options)
    idx.refuse_links(job.out)
    if idx.read_manifest(job.out, options) is None:
        idx.check_folder(job.out, options)
    # One writer at a time: what it reads from here to its commit cannot change under it.
    with Lease(join(job.out, LEASE_FILE), kind="ingest", what=job.out, options=options) as lease:
        manifest = idx.read_manifest(job.out, options)
        if manifest is None:
            idx.mark_folder(job.out, options)
        if job.refresh:
            refresh(job, files, manifest, summary, lease)
            summary.seconds = round(time.perf_counter() - started, 3)
            return summary
        new_files = _new_files(files, manifest, job, summary)
        if not new_files:
            summary.note = "nothing new to ingest: every source is already in the dataset"
        elif job.register:
            register(job, new_files, manifest, summary, lease)
        else:
            _ingest(job, new_files, manifest, summary, lease)
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _new_files(
    files: list[SourceFile], manifest: Manifest | None, job: IngestJob, summary: IngestSummary
) -> list[SourceFile]:
    """Sources not yet in the dataset; refuses changed sources and mismatched settings."""
    if manifest is None:
        return files
    if manifest.registered != job.register:
        kind = "registered (--register)" if manifest.registered else "ingested (not --register)"
        raise PetatrainError(f"{job.out} was {kind}; use the same mode to extend it")
    if not job.register:
        stored = manifest.ingest
        for key in _FIXED_SETTINGS:
            if key in _FIELD_SETTINGS and key not in stored:
                continue  # a dataset from before source fields: an append keeps its layout (`_legacy_ids`)
            ours = getattr(job.config, key)
            if stored.get(key) != ours:
                raise PetatrainError(
                    f"{job.out} was ingested with {key}={stored.get(key)!r}; this run has {key}={ours!r}. "
                    f"Use the same setting or a new --out"
                )
    known = lineage.read_sources(job.out, manifest, job.options, columns=["url", "size", "fingerprint"])
    if job.register:
        _refuse_gone_files(job, known, files)
    # Each listed file's lineage row (null where it is new), without a Python object per known source.
    seen = known.take(pc.index_in(pa.array([f.url for f in files], pa.string()), value_set=known.column("url")))
    fresh = []
    for f, size, fingerprint in zip(
        files, seen.column("size").to_pylist(), seen.column("fingerprint").to_pylist(), strict=True
    ):
        if size is None:
            fresh.append(f)
        elif size != f.size or (fingerprint and f.fingerprint and fingerprint != f.fingerprint):
            again = " (or --register --refresh)" if job.register else ""
            raise PetatrainError(
                f"source {f.url} changed since it was ingested "
                f"(size {size} -> {f.size}); ingest it under a new name{again}"
            )
    summary.files_already_ingested = len(files) - len(fresh)
    if fresh and not job.append:
        raise PetatrainError(
            f"a dataset already exists at {job.out}; pass --append to add the "
            f"{len(fresh)} new source file(s), or choose another --out"
        )
    return fresh


def _ingest(
    job: IngestJob, files: list[SourceFile], manifest: Manifest | None, summary: IngestSummary, lease: Lease
) -> None:
    cfg, options = job.config, job.options
    if job.connect is not None:
        with _stage("ray_init", summary, job):
            job.connect()
    staging = join(job.out, "_staging", uuid.uuid4().hex[:12])
    remove_tree(join(job.out, "_staging"), options)  # a crashed run's; never committed, and we hold the lease
    batch = len(manifest.lineage.batches) + 1 if manifest else 1
    first_file = manifest.lineage.next_file_ord if manifest else 0
    if first_file + len(files) >= 1 << (63 - FILE_BITS):
        raise PetatrainError("too many source files for one dataset")
    lsh = LSHParams.for_threshold(cfg.near_threshold) if cfg.dedup == "near" else None
    summary.files_new = len(files)

    # 1. read, clean, sign
    crypt = _dataset_keys(job, manifest)
    legacy = _legacy_ids(manifest)
    parsed = FieldChoice.parse(cfg.fields, cfg.drop_fields)
    choice = None if legacy or cfg.pack_length or parsed.none else parsed
    if legacy:
        summary.note = (
            f"{job.out} was written before source fields were kept (its document id column is `id`); "
            "this append keeps that layout, without source fields"
        )
    items, split_checksums = _pieces(job, files, first_file, summary, choice)
    stage_one = ReadCleanSign(staging=staging, cfg=cfg, options=options, lsh=lsh, crypt=crypt, fields=choice)
    with _stage("read_clean_sign", summary, job):
        total_bytes = sum(f.size for f in files)
        done = _mapped(
            "read_clean_sign", items, stage_one, job, total_bytes, rows="rows_in", size="size",
            crashed=stage_one.crashed,
        )  # fmt: skip
        file_stats = sorted(done, key=lambda r: (r["file_ord"], r["piece"]))
    # Each piece read what its scan saw (split.check_piece); a file that was replaced as a whole
    # while the scans ran, each scan consistent with the bytes it saw, still shows in its listing.
    for file_ord in split_checksums:
        listed = files[file_ord - first_file]
        if not unchanged(listed, options):
            raise PetatrainError(split.changed(listed.url, "its size or mtime differ from its listing"))
    split_kinds = split_field_types(file_stats) if choice is not None else {}
    fields = _batch_fields(job, manifest, file_stats, choice, crypt) if choice is not None else None
    for stat in file_stats:
        stat["checksum"] = split_checksums.get(stat["file_ord"], stat["checksum"])
        summary.rows_in += stat["rows_in"]
        summary.input_bytes += stat["size"]
        for reason, n in json.loads(stat["rejects"]).items():
            summary.rejected[reason] = summary.rejected.get(reason, 0) + n

    # 2. dedup
    num_groups = max(2, min(len(files), 256))
    drops: dict[int, dict] = {}
    if cfg.dedup != "none":
        with _stage("dedup", summary, job):
            drops = _dedup(job, manifest, file_stats, staging, first_file, lsh, num_groups)
        summary.exact_duplicates = sum(d["exact"] for d in drops.values())
        summary.near_duplicates = sum(d["near"] for d in drops.values())

    # 3. tokenizer (trained on the leading documents, so the result is deterministic)
    tokenizer_json = None
    if cfg.tokenizer:
        with _stage("tokenizer", summary, job):
            tokenizer_json = _tokenizer(job, manifest, staging, file_stats, crypt)

    # 4. shard plan and write (into the dataset's own folder: only while the lease is ours)
    lease.check()
    shard_no = manifest.totals.shards if manifest else 0
    plan_specs = plan_shards(file_stats, drops, parse_size(cfg.shard_size), first_shard=shard_no)
    writer = ShardWriter(
        out=job.out,
        staging=staging,
        cfg=cfg,
        options=options,
        num_groups=num_groups,
        tokenizer_json=tokenizer_json,
        batch=batch,
        keep_state=cfg.dedup != "none",
        crypt=crypt,
        fields=fields,
        staged_fields=frozenset((s["file_ord"], s["piece"]) for s in file_stats if s["fields"]),
        split_kinds=split_kinds,
        id_column="id" if legacy else "doc_id",
    )
    with _stage("write", summary, job):
        written = sorted(
            _mapped("write", plan_specs, writer, job, 0, rows="rows", size="bytes") if plan_specs else [],
            key=lambda r: r["shard"],
        )

    # 5. commit
    with _stage("commit", summary, job):
        new_manifest = _commit(
            job, manifest, files, file_stats, written, staging, batch, first_file, lsh, tokenizer_json, summary, crypt
        )
        lease.check()
        written_record = idx.commit_manifest(job.out, new_manifest, manifest, options)
        idx.remove_old_indexes(job.out, new_manifest, manifest, options)
        lineage.remove_unused(job.out, new_manifest, manifest, options)
        write_card(job.out, new_manifest, options)
        remove_tree(staging, options)
        commit_log.record(job.out, commit_log.committed(job.out, new_manifest, manifest, written_record), options)


def _refuse_gone_files(job: IngestJob, known: pa.Table, files: list[SourceFile]) -> None:
    """A registered dataset indexes files in place: one whose file is gone (Spark rewrote the
    folder, say) must not stay in the index beside the new ones."""
    listed = pa.array([f.url for f in files], pa.string())
    unlisted = known.filter(pc.invert(pc.is_in(known.column("url"), value_set=listed))).column("url").to_pylist()
    gone = [u for u in unlisted if not exists(u, job.options)]
    if gone:
        raise PetatrainError(
            f"{len(gone)} registered file(s) of {job.out} are gone (first: {gone[0]}); "
            "run ingest --register --refresh to make the index exactly the folder's current files"
        )


def _legacy_ids(manifest: Manifest | None) -> bool:
    """Whether the dataset predates source fields: its document id column is `id`, and its
    shards have no other columns an append could add to."""
    if manifest is None or manifest.registered:
        return False
    names = [c.name for c in manifest.schema]
    return "id" in names and "doc_id" not in names


def _batch_fields(
    job: IngestJob, manifest: Manifest | None, file_stats: list[dict], choice: FieldChoice, crypt: DatasetKeys | None
) -> pa.Schema | None:
    """The source fields this batch writes, one type each (`unify_fields`): for an append, the
    dataset's own; with `--fields a,b`, those names even where no record has them."""
    schemas = [pa.ipc.read_schema(pa.py_buffer(s["fields"])) for s in file_stats if s["fields"]]
    existing = None
    if manifest is not None and manifest.totals.shards:
        schema = _shard_schema(job.out, manifest, job.options, crypt)
        existing = pa.schema([f for f in schema if f.name not in RESERVED_COLUMNS])
    unified = unify_fields(schemas, existing)
    for name in choice.keep or ():
        if name not in unified.names and name not in RESERVED_COLUMNS:
            unified = unified.append(pa.field(name, pa.large_string()))
    if existing is not None:  # the dataset's column order, whatever order the new files name them in
        unified = pa.schema([unified.field(n) if n in unified.names else existing.field(n) for n in existing.names])
    return unified if len(unified) else None


def _shard_schema(out: str, manifest: Manifest, options: StorageOptions | None, crypt: DatasetKeys | None) -> pa.Schema:
    """The Arrow schema of the dataset's first shard (every shard has the same)."""
    first = idx.read_shard_index(out, manifest, options).column("path")[0].as_py()
    fs, path = resolve(idx.shard_url(out, manifest, first), options)
    with fs.open(path, "rb") as handle:
        return open_parquet(handle, crypt).schema_arrow


def _dedup(
    job: IngestJob,
    manifest: Manifest | None,
    file_stats: list[dict],
    staging: str,
    first_file: int,
    lsh: LSHParams | None,
    num_groups: int,
) -> dict[int, dict]:
    """Which documents to drop, by file_ord, comparing this batch with itself and with the
    dedup state of the batches before it."""
    import ray

    cfg = job.config
    state_urls = [join(job.out, s["path"]) for s in (manifest.dedup_state if manifest else [])]
    sig_urls = state_urls + [join(staging, "sigs", staged_name(s["file_ord"], s["piece"])) for s in file_stats]
    total = sum(s["kept"] for s in file_stats) + (manifest.totals.rows if manifest else 0)
    plan = dedup_mod.DedupPlan(
        mode=cfg.dedup,
        params=lsh,
        first_new=first_file << FILE_BITS,
        partitions=dedup_mod.partitions_for(
            total, lsh.num_perm if lsh else 0, int(ray.cluster_resources().get("CPU", 1))
        ),
    )
    log.info("dedup: %d signature files, %d partitions", len(sig_urls), plan.partitions)
    return dedup_mod.find_duplicates(
        sig_urls,
        plan,
        groups_url=join(staging, "dups"),
        num_groups=num_groups,
        file_bits=FILE_BITS,
        options=job.options,
        progress=_progress("dedup"),
    )


def _pieces(
    job: IngestJob, files: list[SourceFile], first_file: int, summary: IngestSummary, choice: FieldChoice | None
) -> tuple[list[dict], dict[int, str]]:
    """The first stage's items, one per file or per piece of a split one, and the split files'
    checksums (by file_ord): files over `split_size` that can be split are scanned for record
    boundaries first (one Ray task per chunk). Every item carries its file's Hive partitions."""
    split_bytes = job.config.split_bytes()
    scans = []
    for file_ord, f in enumerate(files, start=first_file):
        fmt = split.split_format(f.url, job.config.format) if split_bytes and f.size > split_bytes else None
        if fmt is not None:
            scans += split.chunks(file_ord, f.url, f.size, fmt, split_bytes)
    plans: dict[int, dict] = {}
    if scans:
        import ray

        # Plain tasks, not a Ray Data pipeline: each is a fraction of a second of I/O and counting,
        # and a pipeline's start-up cost several seconds, as much as the split saved on 300 MB.
        scan = ray.remote(num_cpus=1)(split.scan_chunk)
        with _stage("split", summary, job):
            plans = split.plan_pieces(ray.get([scan.remote(item, job.options) for item in scans]))
    for file_ord, cut in plans.items():
        if choice is not None and cut.get("header_end"):
            header = read_range(files[file_ord - first_file].url, 0, cut["header_end"], job.options)
            kept = split.csv_fields(header, job.config.text_field, choice)
            if kept:
                plans[file_ord] = {
                    "whole": f"a CSV whose columns are kept ({', '.join(kept[:3])}"
                    f"{', ...' if len(kept) > 3 else ''}) is read whole, so Arrow types each from all its rows "
                    "(--fields '' splits it)"
                }
    items, checksums, whole = [], {}, []
    for file_ord, f in enumerate(files, start=first_file):
        plan = plans.get(file_ord)
        partitions = {"partitions": json.dumps(hive_partitions(f.url, f.root))}
        if plan is None or "whole" in plan:
            if plan is not None:
                whole.append(f"{f.url}: {plan['whole']}")
            items.append({**whole_file(file_ord, f.url, f.size), **partitions})
            continue
        checksums[file_ord] = plan["checksum"]
        summary.files_split += 1
        for piece, bounds in enumerate(plan["pieces"]):
            items.append({"file_ord": file_ord, "url": f.url, "size": f.size, "piece": piece, **bounds, **partitions})
    summary.pieces = len(items)
    for line in whole:
        log.warning("not split: %s", line)
    if whole:
        summary.note = "; ".join([summary.note, *whole] if summary.note else whole)
    return items, checksums


@contextlib.contextmanager
def _stage(name: str, summary: IngestSummary, job: IngestJob):
    """Time one stage (the summary reports them, so a slow stage is visible) and tell `job.on_stage`."""
    log.info("ingest: %s ...", name)
    if job.on_stage:
        job.on_stage(name, "start")
    started = time.perf_counter()
    yield
    summary.stage_seconds[name] = round(time.perf_counter() - started, 3)
    log.info("ingest: %s done in %.2fs", name, summary.stage_seconds[name])
    if job.on_stage:
        job.on_stage(name, "done")


def _progress(name: str) -> Callable[[int, int], None]:
    """A progress callback for stages that run as plain Ray tasks."""
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


def _mapped(
    stage: str,
    items: list[dict],
    fn: Any,
    job: IngestJob,
    total_bytes: int,
    *,
    rows: str,
    size: str,
    crashed: Callable[[dict, str], dict] | None = None,
) -> list[dict]:
    """`fn(item)` for every item, one Ray task each (a CPU apiece, results as their tasks end, in
    whatever order; an item whose result is a list, a streamed file's pieces, gives each of them);
    with `job.on_progress`, told as each finishes, with the rows and bytes so far.

    A task whose process dies (killed for memory by the kernel or Ray's monitor, or crashed) is run
    again `constants.TASK_RETRIES` times, then given to `crashed(item, why)` for the result that stands for
    it (the read stage's: a quarantine record of the file); without `crashed`, or when what the task
    raised was its own error, the stage fails with it (the other tasks cancelled). Ray Data's map
    would retry such a task forever: one file that takes more memory than a worker has looped an
    ingest with no error."""
    import ray
    from ray.exceptions import OutOfMemoryError, WorkerCrashedError

    task = ray.remote(num_cpus=1, max_retries=constants.TASK_RETRIES, scheduling_strategy="DEFAULT")(_ingest_task)
    body = ray.put(fn)
    # Tasks in flight: enough to keep every CPU busy, few enough that waiting on them stays cheap.
    window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    queued = iter(items)
    pending: dict[Any, dict] = {}  # a task's ObjectRef -> its item
    started, results = time.perf_counter(), []
    rows_done = bytes_done = finished = 0
    try:
        while True:
            for item in itertools.islice(queued, window - len(pending)):
                pending[task.remote(body, item)] = item
            if not pending:
                break
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            item = pending.pop(ref)
            try:
                result = ray.get(ref)
            except (OutOfMemoryError, WorkerCrashedError) as exc:
                if crashed is None:
                    raise
                why = "out of memory" if isinstance(exc, OutOfMemoryError) else "its process died"
                result = crashed(item, f"the worker reading it was lost {constants.TASK_RETRIES + 1} times ({why})")
            parts = result if isinstance(result, list) else [result]  # a streamed file: one per piece
            results += parts
            finished += 1
            rows_done += sum(int(part.get(rows) or 0) for part in parts)
            bytes_done += sum(int(part.get(size) or 0) for part in parts)
            if job.on_progress is not None:
                progress = StageProgress(
                    items=finished, items_total=len(items), rows=rows_done,
                    bytes=min(bytes_done, total_bytes or bytes_done), bytes_total=total_bytes,
                    elapsed_s=time.perf_counter() - started,
                )  # fmt: skip
                job.on_progress(stage, progress)
    finally:
        for ref in pending:  # a failed stage stops its other tasks
            ray.cancel(ref, force=True)
    return results


def _ingest_task(fn: Any, item: dict) -> dict | list[dict]:
    return fn(item)


def _tokenizer(
    job: IngestJob, manifest: Manifest | None, staging: str, file_stats: list[dict], crypt: DatasetKeys | None
) -> str:
    """The dataset's tokenizer as JSON: the committed one for appends, else built now."""
    if manifest and manifest.tokenizer:
        meta = manifest.tokenizer
        url = join(job.out, meta.path)
        try:  # an append must tokenise exactly as the batches before it did
            return read_verified(url, meta.checksum, job.options).decode()
        except ChecksumMismatch:
            raise PetatrainError(f"{url} does not match the checksum in the manifest; the dataset is damaged") from None
    sample: list[str] = []
    if job.config.tokenizer.startswith("train:"):
        budget = _TOKENIZER_SAMPLE_BYTES
        for stat in file_stats:
            if budget <= 0 or not stat["kept"]:
                continue
            docs = read_parquet(join(staging, "docs", staged_name(stat["file_ord"], stat["piece"])), job.options, crypt)
            docs = docs.read(columns=["text"])
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
    manifest: Manifest | None,
    files: list[SourceFile],
    file_stats: list[dict],
    written: list[dict],
    staging: str,
    batch: int,
    first_file: int,
    lsh: LSHParams | None,
    tokenizer_json: str | None,
    summary: IngestSummary,
    crypt: DatasetKeys | None,
) -> Manifest:
    """Move this batch's rejects, dedup state and tokenizer into place, extend the shard index,
    and return the manifest that commits them (the caller publishes it)."""
    out, options = job.out, job.options
    rejects, state, tokenizer = _place_batch_files(job, manifest, written, staging, batch, tokenizer_json)
    index = idx.append_shards(out, manifest, written, options)
    schema = _schema_of(out, written, options, crypt) if written else (manifest.schema if manifest else [])
    summary.rows_out = sum(w["rows"] for w in written)
    summary.shards = len(written)
    summary.bytes = sum(w["bytes"] for w in written)
    summary.tokens = sum(w["tokens"] for w in written)
    summary.tokens_left_over = sum(w["left_over"] for w in written)
    before = manifest.totals if manifest else Totals()
    totals = Totals(
        shards=before.shards + len(written),
        rows=before.rows + summary.rows_out,
        bytes=before.bytes + summary.bytes,
        documents=before.documents + sum(w["docs"] for w in written),
        rows_in=before.rows_in + summary.rows_in,
        rejected=dict(Counter(before.rejected) + Counter(summary.rejected)),
        exact_duplicates=before.exact_duplicates + summary.exact_duplicates,
        near_duplicates=before.near_duplicates + summary.near_duplicates,
        tokens=before.tokens + summary.tokens,
    )
    checksums = {stat["file_ord"]: stat["checksum"] for stat in file_stats}
    sources = [
        Source(url=f.url, size=f.size, fingerprint=f.fingerprint, checksum=checksums[o], file_ord=o, batch=batch)
        for o, f in enumerate(files, start=first_file)
    ]
    history = lineage.extended(
        out, manifest, sources, Batch(batch=batch, time=now(), files=len(files), rows_out=summary.rows_out), options
    )
    lsh_params = {"num_perm": lsh.num_perm, "bands": lsh.bands, "rows": lsh.rows, "ngram": lsh.ngram} if lsh else {}
    return Manifest(
        created=manifest.created if manifest else now(),
        kind="packed" if job.config.pack_length else "tokens" if job.config.tokenizer else "text",
        schema=schema,
        totals=totals,
        index=index,
        ingest={**asdict(job.config), **lsh_params},
        file_bits=FILE_BITS,
        tokenizer=tokenizer,
        lineage=history,
        dedup_state=state,
        rejects=rejects,
        registered=False,
        encryption=crypt.record if crypt else None,
    )


def _place_batch_files(
    job: IngestJob, manifest: Manifest | None, written: list[dict], staging: str, batch: int, tokenizer_json: str | None
) -> tuple[list[dict], list[dict], TokenizerInfo | None]:
    """Copy this batch's rejects, duplicate records and dedup state into the dataset and write a new
    tokenizer; (rejects, dedup_state, tokenizer) entries of the manifest that will commit them."""
    out, options = job.out, job.options
    rejects = list(manifest.rejects) if manifest else []
    for kind in ("rejects", "dups"):
        for url in listdir(join(staging, kind), options):
            name = f"{'records' if kind == 'rejects' else 'duplicates'}-{os.path.basename(url)}"
            target = f"_rejects/batch-{batch:06d}/{name}"
            copy(url, join(out, target), options)
            rejects.append({"path": target, "batch": batch})
    state = list(manifest.dedup_state) if manifest else []
    for w in written:
        if w["state"]:
            copy(join(staging, "state", os.path.basename(w["state"])), join(out, w["state"]), options)
            state.append({"path": w["state"], "checksum": w["state_checksum"]})
    tokenizer = manifest.tokenizer if manifest else None
    if tokenizer_json and tokenizer is None:
        checksum, _ = atomic_write(join(out, "_index/tokenizer.json"), tokenizer_json.encode(), options)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer_json)
        tokenizer = TokenizerInfo(
            path="_index/tokenizer.json",
            checksum=checksum,
            spec=job.config.tokenizer,
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
            eos_id=tk.eos_id(tok),
            dtype=tk.token_dtype(tok).name,
        )
    return rejects, state, tokenizer


def _schema_of(
    out: str, written: list[dict], options: StorageOptions | None, crypt: DatasetKeys | None
) -> list[Column]:
    fs, path = resolve(join(out, written[0]["path"]), options)
    with fs.open(path, "rb") as handle:
        schema = open_parquet(handle, crypt).schema_arrow
    return [Column(f.name, str(f.type)) for f in schema]


def _dataset_keys(job: IngestJob, manifest: Manifest | None) -> DatasetKeys | None:
    """The keys this batch's shards are written with: the dataset's own if it has them, new ones if
    `storage.encryption.key` turns encryption on; None writes plaintext (refused on an encrypted dataset)."""
    protection = protection_of(job.options)
    keyref = protection.encryption_key
    recorded = manifest.encryption if manifest else None
    if recorded is not None:
        if not keyref:
            raise PetatrainError(
                f"{job.out} is encrypted; set storage.encryption.key (or --encrypt) to the keyring it was "
                "written with, to add to it"
            )
        keys = parquet_crypt.from_record(keyref, recorded, join(job.out, idx.MANIFEST), protection.kms_credentials)
        keys.check()  # a wrong keyring fails here, before anything is read
        return keys
    return parquet_crypt.new_keys(keyref, protection.kms_credentials) if keyref else None
