"""Streaming loader throughput: petatrain vs Mosaic Streaming, Ray Data, a torch map-style Dataset and pyarrow.

Generates two datasets with `petatrain ingest` from one synthetic corpus (nothing is
downloaded), then feeds each to every loader, same bytes, same cores, shuffle on:

- tokens: byte-tokenised and packed, one `tokens` column of fixed_size_binary(1024) (512 uint16);
- text: the raw documents, columns `id` and `text`.

Rows of the table:

- raw read: every Parquet shard read sequentially into memory (the physical limit), and
  the same with an xxh3-128 of each file (the limit when every byte is checksummed);
- pyarrow: ParquetFile.iter_batches over the columns, one process, no shuffle;
- petatrain: `petatrain.data.loader` (checks each shard's xxh3-128 as it opens it);
- Mosaic Streaming: the same rows converted once to MDS (xxh3-128 per shard, zstd for
  text as in the Parquet), read by StreamingDataset in a StreamingDataLoader; the shards are
  "downloaded" from a local remote into a fresh cache, since that is the only path where
  Mosaic validates hashes;
- Ray Data: read_parquet (file order shuffled) + iter_torch_batches with a local shuffle
  buffer as large as petatrain's shuffle window, on a local Ray with every core; Ray's
  start-up and a one-file read that starts its workers are reported, not timed (as on a
  running cluster); the buffer must fill before the first batch;
- torch DataLoader over a map-style Dataset that loads the shards up front (one contiguous
  table, shared with the forked workers) and serves shuffled batches through `__getitems__`.

Every loader yields the same thing: dicts of torch tensors (tokens as (B, 512) uint16) or
lists of str. Each row runs in a fresh process with the page cache warm (the files are read
once before), so the raw read is a memory-bandwidth limit, not a disk one. samples/s counts
one full epoch from constructing the loader to the last batch; GB/s is the dataset's
Parquet bytes over that time, so "vs raw read" is a ratio of epoch times. Resume: a new
process builds a new loader, loads the state saved half-way through the epoch, and times
the first batch; the rest of the epoch is checked against the first run's second half.
A row during which other processes used the CPUs is flagged (its numbers are not to be trusted).
Each row's process freezes its import-time heap (`gc.freeze()`) before it starts timing, so
that keeping the yielded indices does not make the harness time full garbage collections.

    .venv/bin/python benchmarks/loader.py [--tokens-mb 400] [--text-mb 100] [--workers 2] [--batch-size 64]

Prints a table per dataset and writes benchmarks/results/loader.json with the machine.

Mosaic Streaming is not in the `bench` extra: mosaicml-streaming 0.13.0 pins numpy<2.2,
xxhash<4 and transformers<5 and pulls a CUDA torch, none of which it needs at run time.
Install it beside the pinned stack without its dependencies, plus the small ones it imports:

    .venv/bin/pip install --no-deps mosaicml-streaming==0.13.0
    .venv/bin/pip install brotli==1.2.1 python-snappy==0.7.3 zstd==1.5.7.2 catalogue==2.0.10 transformers==5.23.0

(transformers only for two isinstance checks in StreamingDataLoader). `import streaming`
also imports streaming.vision and so torchvision, whose PyPI wheels need a CUDA torch; this
script imports `streaming.base` without the top-level package instead (`_streaming()`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from _common import WORK, corpus, cpu_by_pid, version, write_results  # benchmarks/ is not a package

CORPUS_MB = 300  # the ingest benchmark's corpus, shared through benchmarks/.work
PEERS = ["raw", "raw-xxh3", "pyarrow", "petatrain", "mosaic", "ray", "torch"]
TITLES = {
    "raw": "raw read, 1 thread",
    "raw-xxh3": "raw read + xxh3-128, 1 thread",
    "pyarrow": "pyarrow iter_batches, 1 process, no shuffle",
    "petatrain": "petatrain loader (in process)",
    "mosaic": "Mosaic Streaming (MDS)",
    "ray": "Ray Data iter_torch_batches",
    "torch": "torch DataLoader, map-style Dataset",
}
RESUMABLE = {"petatrain", "mosaic"}
# torch.from_numpy over Arrow's read-only buffers warns once per process; the batches are not written to.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


# -- datasets -----------------------------------------------------------------------------------------


def ingest(name: str, files: list[str], extra: list[str]) -> Path:
    """`petatrain ingest` the files into WORK/loader-<name>, once (its --json summary marks it done)."""
    out = WORK / f"loader-{name}"
    summary = WORK / f"loader-{name}.json"
    if summary.exists() and (out / "_index" / "manifest.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    print(f"ingesting {len(files)} files into {out} ...", file=sys.stderr)
    command = [sys.executable, "-m", "petatrain", "ingest", *files, "--out", str(out), "--dedup", "exact"]
    result = subprocess.run(
        [*command, "--shard-size", "32MB", *extra, "--json"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"petatrain ingest failed:\n{result.stderr[-3000:]}")
    summary.write_text(result.stdout)
    return out


def describe(name: str, url: Path, columns: list[str]) -> dict:
    """What every row needs to know about a dataset: shard files, rows, bytes, token dtype."""
    manifest = json.loads((url / "_index" / "manifest.json").read_text())
    shards = pq.read_table(url / "_index" / "shards.parquet").slice(0, int(manifest["totals"]["shards"]))
    paths = [p if p.startswith("/") else str(url / p) for p in shards.column("path").to_pylist()]
    return {
        "name": name,
        "url": str(url),
        "files": paths,
        "columns": columns,
        "rows": int(sum(shards.column("rows").to_pylist())),
        "bytes": sum(os.path.getsize(p) for p in paths),
        "token_dtype": (manifest.get("tokenizer") or {}).get("dtype", "uint16"),
        "ingest": json.loads((WORK / f"loader-{name}.json").read_text()),
    }


def leading_files(files: list[str], mb: float) -> list[str]:
    """The first files of the corpus that hold at least `mb` MB."""
    chosen, total = [], 0
    for f in files:
        if total >= mb * 1e6:
            break
        chosen.append(f)
        total += os.path.getsize(f)
    return chosen


def convert_to_mds(data: dict) -> str | None:
    """The dataset's rows as MDS shards (once; cached next to it). None if Mosaic is not installed."""
    streaming = _streaming()
    if streaming is None:
        return None
    out = WORK / f"loader-{data['name']}.mds"
    done = out / "DONE"
    if done.exists() and done.read_text() == str(data["rows"]):
        return str(out)
    shutil.rmtree(out, ignore_errors=True)
    print(f"converting {data['name']} to MDS in {out} ...", file=sys.stderr)
    dtype = np.dtype(data["token_dtype"])
    if data["columns"] == ["tokens"]:
        width = pq.read_schema(data["files"][0]).field("tokens").type.byte_width // dtype.itemsize
        columns, compression = {"tokens": f"ndarray:{dtype.name}:{width}", "row": "int64"}, None
    else:
        columns, compression = {"id": "int64", "text": "str", "row": "int64"}, "zstd"
    row = 0
    with streaming.MDSWriter(
        out=str(out), columns=columns, compression=compression, hashes=["xxh3_128"], size_limit=32 << 20
    ) as writer:
        for path in data["files"]:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=4096, columns=data["columns"]):
                if "tokens" in columns:
                    tokens = _tokens(batch.column("tokens"), dtype).numpy()
                    for sample in tokens:
                        writer.write({"tokens": sample, "row": row})
                        row += 1
                else:
                    for doc_id, text in zip(
                        batch.column("id").to_pylist(), batch.column("text").to_pylist(), strict=True
                    ):
                        writer.write({"id": doc_id, "text": text, "row": row})
                        row += 1
    done.write_text(str(row))
    return str(out)


def warm(paths: list[str]) -> None:
    """Read the files once so that every row starts from the same (warm) page cache."""
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass


# -- what every loader yields ---------------------------------------------------------------------------


def _tokens(array: pa.Array | pa.ChunkedArray, dtype: np.dtype):
    """fixed_size_binary(L * itemsize) -> (N, L) tensor over the same memory (what petatrain's loader does)."""
    import torch

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    width = array.type.byte_width // dtype.itemsize
    flat = np.frombuffer(
        array.buffers()[1], dtype=dtype, count=len(array) * width, offset=array.offset * array.type.byte_width
    )
    return torch.from_numpy(flat.reshape(len(array), width))  # (N, L)


def to_torch(batch: pa.Table | pa.RecordBatch, dtype: np.dtype) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for name in batch.column_names:
        column = batch.column(name)
        if pa.types.is_fixed_size_binary(column.type):
            out[name] = _tokens(column, dtype)
        elif pa.types.is_integer(column.type):
            out[name] = torch.from_numpy(column.to_numpy())
        else:
            out[name] = column.to_pylist()
    return out


def _streaming() -> types.ModuleType | None:
    """`streaming.base` (MDSWriter, StreamingDataset, StreamingDataLoader) without `import streaming`.

    The package's __init__ imports streaming.vision -> torchvision, which has no CPU-torch wheel on PyPI;
    nothing used here needs it, so the top-level package is registered empty and only streaming.base runs.
    """
    if "streaming.base" in sys.modules:
        return sys.modules["streaming.base"]
    spec = importlib.util.find_spec("streaming")
    if spec is None:
        return None
    package = types.ModuleType("streaming")
    package.__path__ = list(spec.submodule_search_locations or [])
    package.__spec__ = spec
    sys.modules["streaming"] = package
    import streaming.base

    return streaming.base


# -- the rows (each runs in its own process) ------------------------------------------------------------


class Epoch:
    """Times one pass: first batch, samples, end; keeps the state and the indices after the half-way save.

    The indices are kept as the loader yields them (tensor, array or list) and converted
    only after the pass: converting every batch (~10 us for a tensor) would charge the
    measuring to the loader. The pass ends when its last batch is delivered.
    """

    def __init__(self, total_rows: int, batch_size: int):
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.half = max(0, math.ceil(total_rows / batch_size) // 2 - 1)  # save after this batch
        self.first_s: float | None = None
        self.samples = 0
        self.batches = 0
        self.seen: list[Any] = []
        self.after_save: list[Any] = []

    def batch(self, size: int, index: Any = None) -> bool:
        """Count a batch; True when the caller should save its resume state now."""
        self.ended = time.perf_counter()
        if self.first_s is None:
            self.first_s = self.ended - self.started
        self.samples += size
        if index is not None:
            self.seen.append(index)
            if self.batches > self.half:
                self.after_save.append(index)
        self.batches += 1
        return self.batches - 1 == self.half

    def result(self, **extra: Any) -> dict:
        end = self.ended if self.ended is not None else time.perf_counter()
        out = {"epoch_s": end - self.started, "first_batch_s": self.first_s, "samples": self.samples}
        if self.seen:
            seen = indices(self.seen)
            out["exactly_once"] = bool(len(seen) == self.samples and len(np.unique(seen)) == self.samples)
        return out | extra


def indices(parts: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(p) for p in parts]) if parts else np.empty(0, np.int64)


def row_raw(data: dict, args: argparse.Namespace, xxh3: bool) -> dict:
    import xxhash

    best = math.inf
    for _ in range(3):  # the limit: best of three
        started = time.perf_counter()
        for path in data["files"]:
            with open(path, "rb") as handle:
                payload = handle.read()
            if xxh3:
                xxhash.xxh3_128_digest(payload)
        best = min(best, time.perf_counter() - started)
    return {"epoch_s": best, "samples": data["rows"], "first_batch_s": None, "repeats": 3}


def row_pyarrow(data: dict, args: argparse.Namespace) -> dict:
    dtype = np.dtype(data["token_dtype"])
    epoch = Epoch(data["rows"], args.batch_size)
    for path in data["files"]:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=args.batch_size, columns=data["columns"]):
            out = to_torch(batch, dtype)
            epoch.batch(len(out[data["columns"][0]]))
    return epoch.result(checksums="none (ingest writes no Parquet page checksums)")


def row_petatrain(data: dict, args: argparse.Namespace) -> dict:
    try:
        from petatrain.data import loader
    except Exception as exc:  # not written yet, or mid-edit: the row says so, the others still run
        return {"error": f"petatrain loader not available ({type(exc).__name__}: {exc})"}
    # petatrain's default assembles batches in the calling thread while its prefetch threads
    # fetch, verify and decode the next shards (no worker processes, no IPC);
    # --petatrain-workers N uses N DataLoader processes instead.
    kwargs = {
        "batch_size": args.batch_size,
        "num_workers": args.petatrain_workers,
        "columns": data["columns"],
        "seed": 0,
    }
    if args.resume_state:
        state = json.loads(Path(args.resume_state).read_text())
        started = time.perf_counter()
        dl = loader(data["url"], shuffle=True, **kwargs)
        dl.load_state_dict(state)
        epoch = Epoch(data["rows"], args.batch_size)
        epoch.started = started
        for batch in dl:
            epoch.batch(len(batch["index"]), batch["index"])
        return _resumed(epoch, args)
    epoch = Epoch(data["rows"], args.batch_size)
    dl = loader(data["url"], shuffle=True, **kwargs)
    state = None
    for batch in dl:
        if epoch.batch(len(batch["index"]), batch["index"]):
            state = dl.state_dict()
    _save_resume(args, state, epoch)
    window = getattr(getattr(dl, "dataset", None), "shuffle_window", None)
    return epoch.result(
        wait_s=dl.wait_seconds,
        checksums="xxh3-128 per shard",
        shuffle=f"shard order + window of {window} samples",
        state=state,
    )


def _mosaic_loader(data: dict, args: argparse.Namespace, cache: str):
    streaming = _streaming()
    dataset = streaming.StreamingDataset(
        remote=data["mds"],
        local=cache,
        shuffle=True,
        shuffle_seed=0,
        batch_size=args.batch_size,
        validate_hash="xxh3_128",
    )
    return streaming.StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)


def row_mosaic(data: dict, args: argparse.Namespace) -> dict:
    if not data.get("mds"):
        return {"error": "mosaicml-streaming not installed"}
    _streaming()  # imports outside the timed region
    cache = tempfile.mkdtemp(prefix="mosaic-cache-", dir=WORK)
    try:
        started = time.perf_counter()
        dl = _mosaic_loader(data, args, cache)
        epoch = Epoch(data["rows"], args.batch_size)
        epoch.started = started
        if args.resume_state:
            dl.load_state_dict(json.loads(Path(args.resume_state).read_text()))
            for batch in dl:
                epoch.batch(len(batch["row"]), batch["row"])
            return _resumed(epoch, args)
        state = None
        for batch in dl:
            if epoch.batch(len(batch["row"]), batch["row"]):
                state = dl.state_dict()
        _save_resume(args, state, epoch)
        dataset = dl.dataset
        return epoch.result(
            checksums="xxh3-128 per shard, on copy into the local cache",
            shuffle=f"{dataset.shuffle_algo}, block {dataset.shuffle_block_size} samples",
            state=state,
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def row_ray(data: dict, args: argparse.Namespace) -> dict:
    import ray
    from ray.data.collate_fn import ArrowBatchCollateFn
    from ray.data.datasource import FileShuffleConfig

    dtype = np.dtype(data["token_dtype"])

    class ArrowToTorch(ArrowBatchCollateFn):
        def __call__(self, batch: pa.Table) -> dict[str, Any]:
            return to_torch(batch, dtype)

    started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    init_s = time.perf_counter() - started
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    try:
        # Ray starts its worker processes on first use (several seconds here); start them and Ray Data's
        # imports with a one-file read first, as on a cluster that is already running.
        started = time.perf_counter()
        for _ in ray.data.read_parquet(data["files"][0], columns=data["columns"]).iter_batches(batch_size=1):
            break
        warmup_s = time.perf_counter() - started
        epoch = Epoch(data["rows"], args.batch_size)
        ds = ray.data.read_parquet(data["files"], columns=data["columns"], shuffle=FileShuffleConfig(seed=0))
        batches = ds.iter_torch_batches(
            batch_size=args.batch_size,
            local_shuffle_buffer_size=data["shuffle_rows"],
            local_shuffle_seed=0,
            collate_fn=ArrowToTorch(),
        )
        for batch in batches:
            epoch.batch(len(batch[data["columns"][0]]))
        return epoch.result(
            ray_init_s=init_s,
            ray_warmup_s=warmup_s,
            checksums="none (Parquet page checksums not written)",
            shuffle=f"file order + local buffer of {data['shuffle_rows']} rows",
        )
    finally:
        ray.shutdown()


def row_torch(data: dict, args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.data import DataLoader, Dataset

    dtype = np.dtype(data["token_dtype"])

    class ParquetRows(Dataset):
        """Rows of the shards, loaded up front into one contiguous table; a batch of indices is one Arrow take."""

        def __init__(self, files: list[str], columns: list[str]):
            # One chunk per column: take() over a many-chunk column concatenates it on every call.
            tables = [pq.read_table(f, columns=columns, memory_map=True) for f in files]
            self.table = pa.concat_tables(tables).combine_chunks()

        def __len__(self) -> int:
            return self.table.num_rows

        def __getitems__(self, indices: list[int]) -> dict[str, Any]:
            out = to_torch(self.table.take(indices), dtype)
            out["index"] = torch.tensor(indices)
            return out

    epoch = Epoch(data["rows"], args.batch_size)
    dl = DataLoader(
        ParquetRows(data["files"], data["columns"]),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=_as_is,
        generator=torch.Generator().manual_seed(0),
    )
    for batch in dl:
        epoch.batch(len(batch["index"]), batch["index"])
    return epoch.result(checksums="none", shuffle="global (RandomSampler)")


def _as_is(batch: Any) -> Any:
    return batch


def _save_resume(args: argparse.Namespace, state: dict | None, epoch: Epoch) -> None:
    if state is None:
        return
    stem = Path(args.out).with_suffix("")
    Path(f"{stem}.state.json").write_text(json.dumps(state))
    np.save(f"{stem}.rest.npy", indices(epoch.after_save))


def _resumed(epoch: Epoch, args: argparse.Namespace) -> dict:
    """The resumed pass: time to its first batch, and whether it delivered exactly the first run's rest."""
    expected = np.load(args.resume_rest)
    got = indices(epoch.seen)
    same_rows = bool(len(got) == len(expected) and np.array_equal(np.sort(got), np.sort(expected)))
    return {
        "resume_s": epoch.first_s,
        "samples": epoch.samples,
        "rest_s": time.perf_counter() - epoch.started,
        "same_rows_as_first_run": same_rows,
        "same_order_as_first_run": bool(same_rows and np.array_equal(got, expected)),
    }


ROWS = {
    "raw": lambda d, a: row_raw(d, a, xxh3=False),
    "raw-xxh3": lambda d, a: row_raw(d, a, xxh3=True),
    "pyarrow": row_pyarrow,
    "petatrain": row_petatrain,
    "mosaic": row_mosaic,
    "ray": row_ray,
    "torch": row_torch,
}


# -- orchestration ------------------------------------------------------------------------------------


def run_row(peer: str, data: dict, args: argparse.Namespace, resume: tuple[str, str] | None = None) -> dict:
    """One row in a fresh Python process (so no loader inherits another's threads, Ray or memory)."""
    runs = WORK / "loader-runs"
    runs.mkdir(exist_ok=True)
    spec = runs / f"{data['name']}.json"
    spec.write_text(json.dumps(data))
    out = runs / f"{peer}-{data['name']}{'-resume' if resume else ''}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--row", peer, "--spec", str(spec), "--out", str(out)]
    command += [
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--petatrain-workers",
        str(args.petatrain_workers),
    ]
    if resume:
        command += ["--resume-state", resume[0], "--resume-rest", resume[1]]
    started, before = time.perf_counter(), cpu_by_pid()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.row_timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.row_timeout} s"}
    if not out.exists():
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {result.returncode}: " + " | ".join(tail)}
    row = json.loads(out.read_text())
    wall = time.perf_counter() - started
    row["process_s"] = round(wall, 2)
    # CPU that processes older than the row (another job on these cores) used meanwhile: it skews every number.
    after = cpu_by_pid()
    foreign = sum(after[pid] - cpu for pid, cpu in before.items() if pid in after and pid != os.getpid())
    row["foreign_cpu_share"] = round(max(0.0, foreign) / (wall * (os.cpu_count() or 1)), 3)
    return row


def child(args: argparse.Namespace) -> None:
    import gc

    import torch  # noqa: F401  (every loader yields torch tensors; its import is not the loader's cost)

    data = json.loads(Path(args.spec).read_text())
    # Every row keeps the indices it was given (for the exactly-once check), which sets off a
    # full collection over everything torch, pyarrow and the peers allocated at import (~0.1 s
    # here, once or twice a pass): freeze that import-time heap, for every row alike, as a
    # training process does (torchtitan manages its GC) so the harness does not time it.
    gc.freeze()
    result = ROWS[args.row](data, args)
    Path(args.out).write_text(json.dumps(result, default=float))


def measure(data: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for peer in args.peers:
        print(f"  {data['name']}: {TITLES[peer]} ...", file=sys.stderr)
        row = {"peer": peer, "run": TITLES[peer]} | run_row(peer, data, args)
        stem = WORK / "loader-runs" / f"{peer}-{data['name']}"
        state, rest = Path(f"{stem}.state.json"), Path(f"{stem}.rest.npy")
        if peer in RESUMABLE and "error" not in row and state.exists():
            resumed = run_row(peer, data, args, resume=(str(state), str(rest)))
            row["resume"] = resumed
            row["resume_s"] = resumed.get("resume_s")
            state.unlink()
            rest.unlink()
        rows.append(row)
    return rows


def report(data: dict, rows: list[dict]) -> list[dict]:
    """Print the dataset's table; return the rows with rates and ratios filled in."""
    gb = data["bytes"] / 1e9
    limit = next((r["epoch_s"] for r in rows if r["peer"] == "raw" and "epoch_s" in r), None)
    ray = next((r["epoch_s"] for r in rows if r["peer"] == "ray" and "epoch_s" in r), None)
    print(
        f"\n{data['name']}: {data['rows']} rows, {gb * 1000:.0f} MB of Parquet in {len(data['files'])} shards, "
        f"columns {data['columns']}\n"
    )
    header = f"{'run':<44} {'samples/s':>10} {'GB/s':>7} {'vs raw read':>12} {'vs Ray Data':>12}"
    print(f"{header} {'first batch (s)':>16} {'resume (s)':>11}")
    for row in rows:
        if "error" in row:
            print(f"{row['run']:<44} {row['error']}")
            continue
        seconds = row["epoch_s"]
        row["samples_per_s"] = round(data["rows"] / seconds, 1)
        row["gb_per_s"] = round(gb / seconds, 4)
        row["vs_raw_read"] = round(limit / seconds, 4) if limit else None
        row["vs_ray_data"] = round(ray / seconds, 2) if ray else None
        first = "-" if row.get("first_batch_s") is None else f"{row['first_batch_s']:.2f}"
        resume = "-" if row.get("resume_s") is None else f"{row['resume_s']:.2f}"
        vs_raw = f"{row['vs_raw_read']:.3f}x" if limit else "-"
        vs_ray = f"{row['vs_ray_data']:.2f}x" if ray else "-"
        print(
            f"{row['run']:<44} {row['samples_per_s']:>10.0f} {row['gb_per_s']:>7.3f} {vs_raw:>12} {vs_ray:>12} "
            f"{first:>16} {resume:>11}"
        )
    problems = [
        f"{row['run']}: {what}"
        for row in rows
        for what, bad in (
            (
                f"delivered {row.get('samples')} of {data['rows']} rows",
                row.get("samples", data["rows"]) != data["rows"],
            ),
            ("some row twice or never", row.get("exactly_once") is False),
            (
                "resume did not deliver the rest of the epoch",
                (row.get("resume") or {}).get("same_rows_as_first_run") is False,
            ),
            (f"resume failed: {(row.get('resume') or {}).get('error')}", "error" in (row.get("resume") or {})),
        )
        if bad
    ]
    for line in problems:
        print(f"  CHECK FAILED {line}")
    for row in rows:
        if row.get("foreign_cpu_share", 0) > 0.1:
            print(f"  note: other processes used {row['foreign_cpu_share']:.0%} of the CPUs during {row['run']!r}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-mb", type=int, default=400, help="MB of token data in the tokens dataset (about)")
    parser.add_argument("--text-mb", type=int, default=100, help="MB of JSONL ingested into the text dataset")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="DataLoader workers (all loaders)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--petatrain-workers",
        type=int,
        default=0,
        help="DataLoader worker processes for petatrain (0: in process, with prefetch threads)",
    )
    parser.add_argument(
        "--ray-shuffle-rows",
        type=int,
        default=0,
        help="Ray Data local_shuffle_buffer_size in rows (default 0: as many as petatrain's shuffle window, "
        "4 shards' worth)",
    )
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--row-timeout", type=int, default=600, help="seconds one row may take")
    for hidden in ("--row", "--spec", "--out", "--resume-state", "--resume-rest"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        child(args)
        return
    args.peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in args.peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peer {unknown[0]!r}; choose from {','.join(PEERS)}")

    started = time.perf_counter()
    WORK.mkdir(parents=True, exist_ok=True)
    # Byte tokens are 2 bytes per input byte; ~10% of the JSONL is markup, duplicates and bad records.
    needed = max(args.tokens_mb / 2 * 1.1, args.text_mb)
    files, _ = corpus(max(CORPUS_MB, math.ceil(needed)))
    tokens_files = leading_files(files, args.tokens_mb / 2 * 1.1)
    text_files = leading_files(files, args.text_mb)
    datasets = [
        describe(
            f"tokens-{args.tokens_mb}mb",
            ingest(f"tokens-{args.tokens_mb}mb", tokens_files, ["--tokenizer", "bytes", "--pack-length", "512"]),
            ["tokens"],
        ),
        describe(f"text-{args.text_mb}mb", ingest(f"text-{args.text_mb}mb", text_files, []), ["id", "text"]),
    ]
    for data in datasets:
        window = math.ceil(4 * data["rows"] / len(data["files"]))  # petatrain's default shuffle window
        data["shuffle_rows"] = min(data["rows"], args.ray_shuffle_rows or window)
        data["mds"] = convert_to_mds(data) if "mosaic" in args.peers else None
        warm(data["files"] + ([str(p) for p in Path(data["mds"]).iterdir()] if data["mds"] else []))
    prepared_s = time.perf_counter() - started

    results = {}
    for data in datasets:
        results[data["name"]] = report(data, measure(data, args))
    total_s = time.perf_counter() - started
    print(
        f"\n{os.cpu_count()} cores, {args.workers} loader workers, batch {args.batch_size}; page cache warm; "
        f"Ray Data timed with Ray and its workers up (start-up in the JSON); "
        f"{prepared_s:.0f} s preparing, {total_s:.0f} s in all"
    )
    write_results(
        "loader",
        {
            "parameters": {
                "tokens_mb": args.tokens_mb,
                "text_mb": args.text_mb,
                "workers": args.workers,
                "batch_size": args.batch_size,
                "ray_shuffle_rows": args.ray_shuffle_rows or "petatrain's window (4 shards)",
                "peers": args.peers,
                "page_cache": "warm",
            },
            "datasets": [
                {k: data[k] for k in ("name", "rows", "bytes", "columns", "token_dtype", "shuffle_rows", "ingest")}
                | {"shards": len(data["files"])}
                for data in datasets
            ],
            "results": results,
            "seconds": {"prepare": round(prepared_s, 1), "total": round(total_s, 1)},
        },
        machine_extra={
            "streaming": version("mosaicml-streaming"),
            "numpy": np.__version__,
            "petatrain": version("petatrain"),
        },
    )


if __name__ == "__main__":
    main()
