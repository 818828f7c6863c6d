"""Streaming loader throughput: petatrain vs Mosaic Streaming, Ray Data, a torch map-style Dataset and pyarrow.

Generates two datasets with `petatrain ingest` from one synthetic corpus (nothing is
downloaded), then feeds each to every loader, same bytes, same cores, shuffle on:

- tokens: byte-tokenised and packed, one `tokens` column of fixed_size_binary(1024) (512 uint16);
- text: the raw documents, columns `doc_id` and `text`.

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
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from _common import WORK, corpus, cpu_by_pid, version, write_results  # benchmarks/ is not a package
from loader_rows import ROWS, _streaming, _tokens
from petatrain.data.index import open_dataset

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
    dataset = open_dataset(str(url))
    manifest, shards = dataset.manifest, dataset.shards
    paths = [p if p.startswith("/") else str(url / p) for p in shards.column("path").to_pylist()]
    return {
        "name": name,
        "url": str(url),
        "files": paths,
        "columns": columns,
        "rows": int(sum(shards.column("rows").to_pylist())),
        "bytes": sum(os.path.getsize(p) for p in paths),
        "token_dtype": manifest.tokenizer.dtype if manifest.tokenizer else "uint16",
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
                        batch.column("doc_id").to_pylist(), batch.column("text").to_pylist(), strict=True
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


def _prepare(args: argparse.Namespace) -> list[dict]:
    """Both datasets ingested from the shared corpus, converted to MDS if Mosaic runs, read once (warm)."""
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
        describe(
            f"text-{args.text_mb}mb",
            ingest(f"text-{args.text_mb}mb", text_files, ["--fields", ""]),
            ["doc_id", "text"],
        ),
    ]
    for data in datasets:
        window = math.ceil(4 * data["rows"] / len(data["files"]))  # petatrain's default shuffle window
        data["shuffle_rows"] = min(data["rows"], args.ray_shuffle_rows or window)
        data["mds"] = convert_to_mds(data) if "mosaic" in args.peers else None
        warm(data["files"] + ([str(p) for p in Path(data["mds"]).iterdir()] if data["mds"] else []))
    return datasets


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
    datasets = _prepare(args)
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
