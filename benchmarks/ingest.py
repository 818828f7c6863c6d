"""Ingest throughput with exact + near dedup: petatrain on Ray Data vs datasketch in one process.

Generates a synthetic corpus (default ~300 MB of JSONL with planted exact and near
duplicates and bad records), then runs, on the same files:

- petatrain ingest (local Ray on every core; reported with and without Ray's start-up);
- the same dedup with datasketch (MinHash + MinHashLSH, same shingles, permutations
  and threshold, candidates verified like petatrain's) in one Python process, writing
  its survivors to Parquet too.

Then, on a corpus whose records carry the metadata a crawl keeps (URL, domain, language,
source, date, quality scores, a word count, tags and a nested record: 11 fields, about a
quarter of the bytes), petatrain ingest with every source field kept as a column (`--fields '*'`, the
default) against none kept (`--fields ''`): throughput and bytes written.

Then one large JSONL file (default ~2 GB) ingested twice with the same settings: read whole
by one task (`--split-size 0`, as before files were split) and split into pieces at record
boundaries (the default `--split-size`), reported as MB/s and MB/s per core of the machine.

Prints a table of MB/s of input per core and ratios, and writes
benchmarks/results/ingest.json with the machine it ran on (`--only metadata`: the metadata
comparison alone, in benchmarks/results/ingest-metadata.json).

    .venv/bin/python benchmarks/ingest.py [--mb 300] [--baseline-mb 60] [--metadata-mb 100] [--big-mb 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from _common import WORK, corpus, write_results

_WORD = re.compile(r"\w+")


def run_petatrain(files: list[str], threshold: float, extra: tuple[str, ...] = (), name: str = "petatrain-ds") -> dict:
    import subprocess

    out = WORK / name
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "petatrain",
            "ingest",
            *files,
            "--out",
            str(out),
            "--dedup",
            "near",
            "--near-threshold",
            str(threshold),
            "--shard-size",
            "64MB",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"petatrain ingest failed:\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout)
    import ray  # noqa: F401  (cores Ray used: all of them by default)

    shutil.rmtree(out, ignore_errors=True)  # the big-file datasets are GBs
    return {
        "wall_s": wall,
        "summary": summary,
        "cores": os.cpu_count(),
        "pipeline_s": summary["seconds"] - summary["stage_seconds"].get("ray_init", 0.0),
    }


def metadata_corpus(files: list[str], mb: int) -> tuple[list[str], int]:
    """The leading `mb` MB of the corpus, each record given the metadata fields a crawl keeps
    (made once in benchmarks/.work); bad records stay as they are."""
    import random

    folder = WORK / f"corpus-metadata-{mb}mb"
    if not (folder / "DONE").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        rng = random.Random(1)
        langs, sources = ["en", "de", "fr", "es", "ja"], ["cc-2026-11", "wiki", "books", "code", "forums"]
        written = 0
        for path in files:
            if written >= mb * 1e6:
                break
            lines = []
            for line in Path(path).read_bytes().split(b"\n"):
                try:
                    record = json.loads(line)
                    assert isinstance(record, dict)
                except Exception:
                    lines.append(line)
                    continue
                host = f"www.site{rng.randrange(100_000)}.example.org"
                record |= {
                    "url": f"https://{host}/articles/{rng.randrange(10**9)}/page.html",
                    "domain": host,
                    "lang": rng.choice(langs),
                    "source": rng.choice(sources),
                    "crawl_date": f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}T00:00:00Z",
                    "quality": round(rng.random(), 4),
                    "toxicity": round(rng.random() / 10, 5),
                    "perplexity": round(rng.uniform(5, 500), 2),
                    "word_count": len(str(record.get("text", "")).split()),
                    "tags": rng.sample(["news", "blog", "forum", "reference", "code", "faq"], 2),
                    "warc": {"file": f"crawl-{rng.randrange(90_000):05d}.warc.gz", "offset": rng.randrange(1 << 32)},
                }
                lines.append(json.dumps(record).encode())
            out = folder / Path(path).name
            out.write_bytes(b"\n".join(lines))
            written += out.stat().st_size
        (folder / "DONE").write_text("")
    made = sorted(str(p) for p in folder.glob("*.jsonl"))
    return made, sum(os.path.getsize(f) for f in made)


def run_metadata(files: list[str], mb: int, threshold: float, repeats: int = 2) -> dict:
    """Ingest the metadata corpus with every source field kept, then with none: MB/s and bytes."""
    meta_files, total = metadata_corpus(files, mb)
    plain = sum(os.path.getsize(f) for f in files if Path(f).name in {Path(m).name for m in meta_files})
    runs: dict[str, dict] = {}
    # Alternating, `repeats` times each; the faster run of each counts (a shared machine's other
    # work only ever slows a run down).
    for _ in range(repeats):
        for label, fields in (("fields kept (--fields '*')", "*"), ("no fields (--fields '')", "")):
            ours = run_petatrain(meta_files, threshold, ("--fields", fields), name="petatrain-metadata-ds")
            s = ours["summary"]
            row = {
                "pipeline_s": round(ours["pipeline_s"], 2),
                "mb_per_s_per_core": round(total / 1e6 / ours["pipeline_s"] / ours["cores"], 2),
                "bytes_written": s["bytes"],
                "rows_out": s["rows_out"],
                "stage_seconds": s["stage_seconds"],
            }
            best = runs.setdefault(label, row | {"samples_s": []})
            best["samples_s"].append(row["pipeline_s"])
            if row["pipeline_s"] < best["pipeline_s"]:
                runs[label] = row | {"samples_s": best["samples_s"]}
    on, off = runs.values()
    print(
        f"\nsource fields kept vs not, {total / 1e6:.0f} MB corpus, 11 metadata fields per record "
        f"({1 - plain / total:.0%} of the input bytes)\n"
    )
    print(f"{'run':<30} {'s':>7} {'MB/s/core':>10} {'MB written':>11}")
    for label, r in runs.items():
        print(f"{label:<30} {r['pipeline_s']:>7.1f} {r['mb_per_s_per_core']:>10.1f} {r['bytes_written'] / 1e6:>11.1f}")
    ratio = {
        "throughput_kept_vs_none": round(on["mb_per_s_per_core"] / off["mb_per_s_per_core"], 3),
        "bytes_kept_vs_none": round(on["bytes_written"] / off["bytes_written"], 3),
    }
    print(f"kept / none: throughput {ratio['throughput_kept_vs_none']}x, bytes {ratio['bytes_kept_vs_none']}x")
    share = round(1 - plain / total, 3)
    return {"corpus_mb": round(total / 1e6, 1), "metadata_share_of_input": share, "runs": runs, **ratio}


def run_datasketch(files: list[str], budget_bytes: int, threshold: float) -> dict:
    """The same cleaning rules and dedup, sequentially, with datasketch's MinHash + LSH."""
    from datasketch import MinHash, MinHashLSH

    from petatrain.data.ingest.minhash import LSHParams

    params = LSHParams.for_threshold(threshold)
    lsh = MinHashLSH(num_perm=params.num_perm, params=(params.bands, params.rows))
    seen: set[int] = set()
    kept_text: list[str] = []
    sigs: dict[int, np.ndarray] = {}
    stats = {"rows_in": 0, "rejected": 0, "exact": 0, "near": 0, "bytes": 0}
    started = time.perf_counter()
    for path in files:
        if stats["bytes"] >= budget_bytes:
            break
        data = Path(path).read_bytes()
        stats["bytes"] += len(data)
        for line in data.split(b"\n"):
            if not line.strip():
                continue
            stats["rows_in"] += 1
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str) or not text.strip():
                    raise ValueError
                text.encode("utf-8")
            except (ValueError, KeyError, TypeError, UnicodeError):
                stats["rejected"] += 1
                continue
            digest = xxhash.xxh3_128_intdigest(text.encode())
            if digest in seen:
                stats["exact"] += 1
                continue
            seen.add(digest)
            words = _WORD.findall(text.lower())
            shingles = [" ".join(words[i : i + params.ngram]).encode() for i in range(max(1, len(words) - 4))]
            m = MinHash(num_perm=params.num_perm)
            m.update_batch(shingles)
            if any(float(np.mean(sigs[c] == m.hashvalues)) >= threshold for c in lsh.query(m)):
                stats["near"] += 1
                continue
            key = len(kept_text)
            lsh.insert(key, m)
            sigs[key] = m.hashvalues
            kept_text.append(text)
    pq.write_table(pa.table({"text": kept_text}), WORK / "datasketch.parquet", compression="zstd")
    stats["seconds"] = time.perf_counter() - started
    stats["rows_out"] = len(kept_text)
    return stats


def big_file(mb: int) -> tuple[str, int]:
    """One synthetic JSONL file of about `mb` MB in benchmarks/.work, made once; (path, bytes)."""
    from petatrain.data import synth

    folder = WORK / f"big-{mb}mb"
    path, marker = folder / "big.jsonl", folder / "DONE"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"generating one ~{mb} MB JSONL file in {folder} ...", file=sys.stderr)
        parts = folder / "parts"
        synth.generate(str(parts), documents=int(mb * 1e6 / 1200), files=max(4, mb // 100), mean_words=150, seed=2)
        with open(path, "wb") as out:
            for part in sorted(parts.glob("*.jsonl")):
                with open(part, "rb") as handle:
                    shutil.copyfileobj(handle, out, 8 << 20)
        shutil.rmtree(parts)
        marker.write_text("")
    return str(path), path.stat().st_size


def run_big_file(mb: int, threshold: float) -> dict:
    """The same large file read whole by one task, then split into pieces (the default split size)."""
    path, size = big_file(mb)
    runs = {}
    for label, extra in (("unsplit", ("--split-size", "0")), ("split", ())):
        print(f"big file, {label} ...", file=sys.stderr)
        runs[label] = run_petatrain([path], threshold, extra, name=f"big-{label}-ds")
    cores = os.cpu_count() or 1
    mb_in = size / 1e6
    print(f"\none {mb_in:.0f} MB JSONL file, near dedup, {cores} cores\n")
    print(f"{'run':<28} {'pieces':>6} {'s':>7} {'read s':>7} {'MB/s':>7} {'MB/s/core':>10} {'vs unsplit':>11}")
    rows = []
    for label, r in runs.items():
        s = r["summary"]
        rows.append(
            {
                "run": f"one file, {label}",
                "mb": round(mb_in, 1),
                "pieces": s["pieces"],
                "seconds": round(r["pipeline_s"], 2),
                "read_clean_sign_s": s["stage_seconds"]["read_clean_sign"],
                "split_scan_s": s["stage_seconds"].get("split", 0.0),
                "mb_per_s": round(mb_in / r["pipeline_s"], 2),
                "cores": cores,
                "mb_per_s_per_core": round(mb_in / r["pipeline_s"] / cores, 2),
                "rows_out": s["rows_out"],
            }
        )
    for row in rows:
        row["ratio_vs_unsplit"] = round(row["mb_per_s"] / rows[0]["mb_per_s"], 2)
        print(
            f"{row['run']:<28} {row['pieces']:>6} {row['seconds']:>7.1f} {row['read_clean_sign_s']:>7.1f} "
            f"{row['mb_per_s']:>7.1f} {row['mb_per_s_per_core']:>10.1f} {row['ratio_vs_unsplit']:>10.2f}x"
        )
    same = rows[0]["rows_out"] == rows[1]["rows_out"]
    print(f"(pipeline seconds, Ray up; the split run's scan took {rows[1]['split_scan_s']:.1f} s of it)")
    print(f"same rows out split and unsplit: {same}")
    return {"file_mb": round(mb_in, 1), "results": rows, "same_rows_out": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=300, help="corpus size in MB")
    parser.add_argument(
        "--baseline-mb",
        type=int,
        default=60,
        help="MB of the same corpus (leading files) the one-process baseline processes; "
        "its rate per core is what is compared",
    )
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument(
        "--big-mb", type=int, default=2000, help="size of the one-large-file run, split vs unsplit (0: skip it)"
    )
    parser.add_argument("--metadata-mb", type=int, default=100, help="MB of the metadata corpus (fields kept vs not)")
    parser.add_argument("--only", choices=["all", "metadata"], default="all")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.only == "metadata":
        files, _ = corpus(args.metadata_mb)
        metadata = run_metadata(files, args.metadata_mb, args.threshold)
        write_results("ingest-metadata", {"threshold": args.threshold, **metadata})
        return
    files, total = corpus(args.mb)
    mb = total / 1e6

    ours = run_petatrain(files, args.threshold)
    base = run_datasketch(files, int(args.baseline_mb * 1e6), args.threshold)

    s = ours["summary"]
    rows = [
        ("petatrain ingest, end to end (incl. Ray start)", mb, ours["wall_s"], ours["cores"]),
        ("petatrain ingest, pipeline (Ray up)", mb, ours["pipeline_s"], ours["cores"]),
        ("datasketch MinHash+LSH, one process", base["bytes"] / 1e6, base["seconds"], 1),
    ]
    base_rate = rows[2][1] / rows[2][2]
    print(
        f"\ningest with exact + near dedup (threshold {args.threshold}), {mb:.0f} MB corpus, {os.cpu_count()} cores\n"
    )
    print(f"{'run':<50} {'MB':>7} {'s':>7} {'MB/s':>7} {'MB/s/core':>10} {'vs datasketch/core':>19}")
    results = []
    for name, size, seconds, cores in rows:
        rate = size / seconds
        per_core = rate / cores
        print(f"{name:<50} {size:>7.0f} {seconds:>7.1f} {rate:>7.1f} {per_core:>10.1f} {per_core / base_rate:>18.1f}x")
        results.append(
            {
                "run": name,
                "mb": round(size, 1),
                "seconds": round(seconds, 2),
                "mb_per_s": round(rate, 2),
                "cores": cores,
                "mb_per_s_per_core": round(per_core, 2),
                "ratio_vs_datasketch_per_core": round(per_core / base_rate, 2),
            }
        )
    print(
        f"\npetatrain: {s['rows_in']} records in, {s['exact_duplicates']} exact + {s['near_duplicates']} near "
        f"duplicates, {sum(s['rejected'].values())} rejected, {s['rows_out']} out; stages {s['stage_seconds']}"
    )
    share = base["bytes"] / total
    print(
        f"datasketch ({share:.0%} of the corpus): {base['rows_in']} records in, {base['exact']} exact + "
        f"{base['near']} near duplicates, {base['rejected']} rejected, {base['rows_out']} out"
    )
    metadata = run_metadata(files, args.metadata_mb, args.threshold)
    target = results[1]["mb_per_s_per_core"] >= 10 and results[1]["ratio_vs_datasketch_per_core"] > 1
    print(
        f"target (>= 10 MB/s per core with near dedup, faster than datasketch per core): "
        f"{'met' if target else 'NOT met'}"
    )
    big = run_big_file(args.big_mb, args.threshold) if args.big_mb else None
    write_results(
        "ingest",
        {
            "corpus_mb": round(mb, 1),
            "threshold": args.threshold,
            "results": results,
            "petatrain_summary": s,
            "datasketch": base,
            "metadata_columns": metadata,
            "target_met": target,
            "big_file": big,
        },
    )


if __name__ == "__main__":
    main()
