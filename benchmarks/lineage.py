"""Lineage at millions of source files: manifest version 1 (every source in manifest.json) vs
version 2 (a Parquet lineage table beside the index; the manifest keeps totals and a pointer).

For each size it writes a synthetic dataset (one shard; N source files with S3-like URLs,
ETags and checksums) in both layouts and measures, each in a fresh process:

- manifest size, and the lineage table's;
- open: `index.open_dataset` (what the loader, `inspect` and training do), seconds and the
  process's peak memory above a bare import;
- read lineage: every source's URL, size and fingerprint, as an `--append` reads them to
  tell new files from ingested ones.

Version 1 at 10^7 would be a ~2 GB JSON file taking tens of GB of Python objects to parse:
it runs up to `--v1-max` (default 10^6) and the table gives its larger sizes as "-".

    .venv/bin/python benchmarks/lineage.py [--sizes 100000,1000000,10000000] [--v1-max 1000000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from _common import WORK, write_results

# Run in a fresh process: memory is its peak above what it held after opening a ten-file dataset
# (imports and lazy imports done); time is the second of two opens.
_PROBE = r"""
import json, os, sys, time
from petatrain.data import index, lineage
url, what, warm = sys.argv[1], sys.argv[2], sys.argv[3]
lineage.read_sources(warm, index.open_dataset(warm).manifest)
with open("/proc/self/statm") as handle:
    before = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def run():
    dataset = index.open_dataset(url)
    if what == "sources":
        return lineage.read_sources(url, dataset.manifest, columns=["url", "size", "fingerprint"]).num_rows
    return dataset.manifest.lineage.num_sources

rows = run()
with open("/proc/self/status") as handle:  # VmHWM: ru_maxrss would count the parent's memory at fork
    peak = next(int(line.split()[1]) for line in handle if line.startswith("VmHWM")) / 1024
t0 = time.perf_counter()
run()
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_mib": peak, "above_import_mib": peak - before, "rows": rows}))
"""


def sources(n: int, seed: int = 0) -> pa.Table:
    """N source files as a crawl would list them: S3 URLs, sizes, ETags, xxh3-128 checksums."""
    rng = np.random.default_rng(seed)
    ids = np.arange(n)
    urls = pa.array([f"s3://lake/crawl/2026-11/segment-{i // 1000:05d}/part-{i:09d}.jsonl.gz" for i in ids.tolist()])
    hexes = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64)
    checksums = pa.array([f"{a:016x}{b:016x}" for a, b in hexes.tolist()])
    etags = pa.array([f"ETag:{b:016x}{a:016x}" for a, b in hexes.tolist()])
    return pa.table(
        {
            "url": urls,
            "size": rng.integers(1 << 20, 1 << 30, size=n, dtype=np.int64),
            "fingerprint": etags,
            "checksum": checksums,
            "batch": np.ones(n, dtype=np.int64),
            "file_ord": ids.astype(np.int64),
        }
    )


def write_dataset(folder, table: pa.Table, version: int) -> dict:
    """A committed one-shard dataset whose lineage is `table`, in the layout of `version`."""
    from petatrain.data import index, lineage
    from petatrain.data.manifest import Batch, Column, Lineage, Manifest, Source, Totals
    from petatrain.storage.checksum import checksum_bytes

    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data").mkdir(parents=True)
    shard = pa.table({"doc_id": [0], "text": ["one document"]})
    pq.write_table(shard, folder / "data" / "part-000000.parquet")
    data = (folder / "data" / "part-000000.parquet").read_bytes()
    url = str(folder)
    shard_row = {"path": "data/part-000000.parquet", "rows": 1, "bytes": len(data), "checksum": checksum_bytes(data)}
    index_file = index.append_shards(url, None, [shard_row])
    n = table.num_rows
    batch = Batch(batch=1, time="2026-11-24T00:00:00Z", files=n, rows_out=1)
    if version == 1:
        history = Lineage(sources=[Source(**row) for row in table.to_pylist()], batches=[batch], next_file_ord=n)
    else:
        history = Lineage(batches=[batch], next_file_ord=n, parts=[lineage.write_part(url, table)], source_count=n)
    manifest = Manifest(
        kind="text",
        schema=[Column("doc_id", "int64"), Column("text", "string")],
        totals=Totals(shards=1, rows=1, bytes=len(data), documents=1, rows_in=1),
        lineage=history,
        index=index_file,
    )
    started = time.perf_counter()
    index.write_manifest(url, manifest)
    record = json.loads((folder / "_index" / "manifest.json").read_text()) if version == 1 else None
    if record is not None:  # what petatrain before lineage tables wrote
        record["version"] = 1
        (folder / "_index" / "manifest.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    written = time.perf_counter() - started
    tables = (folder / "_index" / "lineage").glob("*.parquet") if version == 2 else []
    table_bytes = sum(p.stat().st_size for p in tables)
    return {
        "manifest_bytes": (folder / "_index" / "manifest.json").stat().st_size,
        "lineage_table_bytes": table_bytes,
        "write_manifest_s": round(written, 3),
    }


def probe(folder, what: str) -> dict:
    warm = str(WORK / "lineage-warm")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(folder), what, warm], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-2000:] or f"exit {out.returncode}"}
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000,10000000", help="numbers of source files")
    parser.add_argument("--v1-max", type=int, default=1_000_000, help="largest size run in the version-1 layout")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    write_dataset(WORK / "lineage-warm", sources(10), 2)
    rows = []
    for n in sizes:
        table = sources(n)
        for version in (1, 2):
            if version == 1 and n > args.v1_max:
                continue
            folder = WORK / f"lineage-v{version}-{n}"
            written = write_dataset(folder, table, version)
            opened = probe(folder, "open")
            read = probe(folder, "sources")
            row = {"sources": n, "manifest_version": version, **written, "open": opened, "read_sources": read}
            rows.append(row)
            print(
                f"{n:>10,} files  v{version}: manifest {written['manifest_bytes'] / 1e6:9.3f} MB  "
                f"table {written['lineage_table_bytes'] / 1e6:7.1f} MB  "
                f"open {opened.get('seconds', float('nan')):7.3f} s ({opened.get('above_import_mib', 0):7.1f} MiB)  "
                f"read sources {read.get('seconds', float('nan')):7.3f} s ({read.get('above_import_mib', 0):7.1f} MiB)",
                flush=True,
            )
            shutil.rmtree(folder, ignore_errors=True)
        del table
    print(
        f"\n{'files':>11} {'version':>7} {'manifest MB':>12} {'table MB':>9} {'open s':>8} {'open MiB':>9}"
        f" {'sources s':>10} {'sources MiB':>12}"
    )
    for r in rows:
        o, s = r["open"], r["read_sources"]
        print(
            f"{r['sources']:>11,} {r['manifest_version']:>7} {r['manifest_bytes'] / 1e6:>12.3f} "
            f"{r['lineage_table_bytes'] / 1e6:>9.1f} {o.get('seconds', float('nan')):>8.3f} "
            f"{o.get('above_import_mib', float('nan')):>9.1f} {s.get('seconds', float('nan')):>10.3f} "
            f"{s.get('above_import_mib', float('nan')):>12.1f}"
        )
    write_results("lineage", {"sizes": sizes, "v1_max": args.v1_max, "results": rows})


if __name__ == "__main__":
    main()
