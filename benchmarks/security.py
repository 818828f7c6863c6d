"""What encryption at rest costs: loader, checkpoint and ingest, encrypted vs plaintext, one run.

- loader: the same packed-token corpus ingested twice (plaintext; `--encrypt`, Parquet modular
  encryption), then `StreamingDataset.iter_batches` over every sample for `--epochs` epochs,
  single process, the runs interleaved (plain, encrypted, plain, ...) so drift hits both;
  `--pairs` pairs, the median of the pairs' ratios (and the best of each). Two cuts of the
  corpus: many shards (2 MB of text each, ~15 shuffle windows: the steady state of a dataset
  larger than a window, the goal's row) and 3 shards (the whole dataset one window: each epoch
  decrypts it all at once). Peer row: pyarrow reading the encrypted shards directly with the
  same decryption properties (what any Parquet reader holding the key pays). Goal: >= 70%.
- checkpoint: a GPT's weights + AdamW state through the real `CheckpointWriter` (single rank,
  local disk): the loop's stall (submit) and the background write time, sealed (AES-256-GCM
  chunks, signed) vs plain safetensors; median of `--repeats`.
- ingest: `api.ingest` of the corpus (read, clean, exact dedup, byte tokenizer, pack) into a new
  dataset, encrypted vs plaintext, on the local Ray; median of `--repeats`.
- Ray's TLS (`--ray-tls`, needs root for network namespaces): the two-node network-namespace
  cluster started plain, then with TLS on every node; on each, `petatrain train` of a small GPT on
  2 workers (one per node, so every step's gradients cross the link), rank 1 killed at step 15.
  Median step time (steps 5-14, before the kill) and the restart time the report measures.

    .venv/bin/python benchmarks/security.py [--documents 100000] [--epochs 8] [--pairs 9] [--repeats 5] [--ray-tls]

Prints a table of ratios and writes benchmarks/results/security.json with the machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from dataclasses import replace

import pyarrow as pa
import torch

from _common import WORK, write_results
from petatrain import api, config
from petatrain.data import synth
from petatrain.data.index import dataset_keys, open_dataset
from petatrain.data.loading.stream import StreamingDataset
from petatrain.security import keys
from petatrain.security.parquet_crypt import open_parquet
from petatrain.security.protection import Protection
from petatrain.storage import StorageOptions


def loader_rate(url: str, options: StorageOptions, epochs: int) -> float:
    ds = StreamingDataset(url, batch_size=64, options=options, seed=1)
    start, n = time.perf_counter(), 0
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in ds.iter_batches():
            n += len(batch["tokens"])
    return n / (time.perf_counter() - start)


def pyarrow_rate(url: str, options: StorageOptions, epochs: int) -> float:
    dataset = open_dataset(url, options)
    crypt = dataset_keys(url, dataset.manifest, options)
    paths = [dataset.shard_url(p) for p in dataset.shards.column("path").to_pylist()]
    start, n = time.perf_counter(), 0
    for _ in range(epochs):
        for path in paths:
            table = open_parquet(pa.memory_map(path), crypt).read()
            n += table.num_rows
    return n / (time.perf_counter() - start)


def checkpoint_times(run: str, options: StorageOptions, params: int, repeats: int) -> dict[str, float]:
    from petatrain.train.checkpoint import CheckpointWriter, Snapshot

    tensors = {
        "model/w": torch.randn(params),
        "optim/w/exp_avg": torch.randn(params),
        "optim/w/exp_avg_sq": torch.rand(params),
    }
    parts: dict = {}
    writer = CheckpointWriter(
        run,
        options,
        report_part=lambda s, r, f: parts.__setitem__(s, f),
        wait_parts=lambda s, w, t: parts.get(s),
        on_commit=lambda info: None,
        keep_last=2,
    )
    stalls, writes = [], []
    meta = {"loader": {"position": 0}, "strategy": "ddp", "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        writer.submit(Snapshot(step=step, rank=0, world_size=1, tensors=tensors, meta=meta))
        stalls.append(time.perf_counter() - t0)
        writer.wait()
        assert writer.error is None, writer.error
        writes.append(writer.last_write_s)
    writer.close()
    return {"stall_s": statistics.median(stalls), "write_s": statistics.median(writes)}


def ray_tls_rows(corpus: str, folder: str) -> dict[str, dict[str, float]]:
    """Step and restart time of the same short training on the two-node cluster, plain and TLS."""
    import json
    import sys

    from _common import ROOT
    from petatrain.chaos.netns import TwoNodeCluster
    from petatrain.observe.ledger import read_events
    from petatrain.runtime.tls import make_certificates

    dataset = f"{folder}/tokens65"  # examples/tiny.yaml's 64-token context
    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="2MB", dedup="none")
    api.ingest([corpus], dataset, config=cfg)
    import ray

    ray.shutdown()  # the training runs on the two-node cluster, not on this process's local Ray
    files = make_certificates(f"{folder}/tls", ["10.234.0.1", "10.234.0.2"])
    rows = {}
    for name, node_env in (("plain", {}), ("tls", files.env())):
        run_dir = f"{folder}/ray-{name}"
        with TwoNodeCluster(head_cpus=1, worker_cpus=1, subnet="10.234.0", node_env=node_env) as cluster:
            argv = [sys.executable, "-m", "petatrain", "train", str(ROOT / "examples" / "tiny.yaml"), "--json"]
            overrides = [f"data.dataset={dataset}", "train.steps=30", "parallel.workers=2", "checkpoint.every=10"]
            if node_env:
                overrides += [
                    f"resources.tls.{k}={v}" for k, v in (("ca", files.ca), ("cert", files.cert), ("key", files.key))
                ]
            for override in overrides:
                argv += ["--set", override]
            argv += ["--address", cluster.address, "--run-dir", run_dir, "--inject", "kill@step=15,rank=1"]
            done = cluster.run(argv, env={"RAY_USE_TLS": "0"}, timeout=600, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name}: {done.stderr[-2000:]}")
        steps = [e["step_s"] for e in read_events(run_dir) if e["event"] == "step" and 5 <= e["step"] < 15]
        fault = json.loads(done.stdout)["report"]["faults"][0]
        rows[name] = {
            "step_s": statistics.median(steps),
            "restart_s": fault["restart_s"],
            "recovered_s": fault["recovered_after_s"],
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=9, help="loader runs, plaintext then encrypted")
    parser.add_argument("--repeats", type=int, default=5, help="ingest and checkpoint runs")
    parser.add_argument("--params", type=int, default=25_000_000, help="checkpointed floats per tensor (x3)")
    parser.add_argument("--ray-tls", action="store_true", help="also Ray's TLS on the two-node cluster (root)")
    args = parser.parse_args()
    root = WORK / "security"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ring = root / "ring.json"
    keys.create_keyring(str(ring))
    ref = f"file:{ring}"
    plain, sealed = StorageOptions(), StorageOptions(protection=Protection(encryption_key=ref, signing_key=ref))
    synth.generate(str(root / "corpus"), documents=args.documents, files=4, seed=5)
    mb = sum(p.stat().st_size for p in (root / "corpus").iterdir()) / 1e6
    # Three shards for the ingest rows (and the one-window loader row).
    cfg = config.IngestConfig(tokenizer="bytes", pack_length=1025, shard_size=f"{mb / 3 + 1:.0f}MB", dedup="exact")

    ingest_s: dict[str, list[float]] = {"plain": [], "encrypted": []}
    for i in range(args.repeats):
        for name, options in (("plain", plain), ("encrypted", sealed)):
            out = root / f"{name}-{i}"
            summary = api.ingest([str(root / "corpus")], str(out), config=cfg, options=options)
            ingest_s[name].append(summary.seconds)
    many = replace(cfg, shard_size="2MB")
    for name, options in (("plain", plain), ("encrypted", sealed)):
        api.ingest([str(root / "corpus")], str(root / f"{name}-many"), config=many, options=options)

    cuts = {"many shards": "many", "3 shards": "0"}  # dataset cut -> folder suffix
    loader: dict[str, dict[str, list[float]]] = {}
    for cut, suffix in cuts.items():
        rates: dict[str, list[float]] = {"plain": [], "encrypted": []}
        for _ in range(args.pairs):
            rates["plain"].append(loader_rate(str(root / f"plain-{suffix}"), plain, args.epochs))
            rates["encrypted"].append(loader_rate(str(root / f"encrypted-{suffix}"), sealed, args.epochs))
        loader[cut] = rates
    peer = max(pyarrow_rate(str(root / "encrypted-many"), sealed, args.epochs) for _ in range(args.repeats))
    shards = {cut: len(open_dataset(str(root / f"plain-{suffix}"), plain).shards) for cut, suffix in cuts.items()}
    pairs = {cut: [e / p for p, e in zip(r["plain"], r["encrypted"], strict=True)] for cut, r in loader.items()}

    ckpt = {
        "plain": checkpoint_times(str(root / "run-plain"), plain, args.params, args.repeats),
        "encrypted": checkpoint_times(str(root / "run-sealed"), sealed, args.params, args.repeats),
    }
    gb = 3 * args.params * 4 / 1e9

    print(f"\nloader: {args.epochs} epochs of packed 1025-token rows, {args.pairs} alternating pairs")
    print(f"{'dataset':<22}{'plain /s (best)':>17}{'encrypted /s (best)':>21}{'ratio (median pair)':>21}   pairs")
    for cut, r in loader.items():
        ratios = " ".join(f"{x:.2f}" for x in pairs[cut])
        print(
            f"{f'{cut} ({shards[cut]})':<22}{max(r['plain']):>17.0f}{max(r['encrypted']):>21.0f}"
            f"{statistics.median(pairs[cut]):>21.2f}   {ratios}"
        )
    peer_ratio = peer / max(loader["many shards"]["plain"])
    print(f"pyarrow reading the encrypted many-shard files: {peer:.0f}/s, {peer_ratio:.2f} of the loader's plaintext")
    print(f"\ncheckpoint of {gb:.2f} GB (median of {args.repeats})")
    print(f"{'':<12}{'stall s':>10}{'write s':>10}{'GB/s':>8}")
    for name, t in ckpt.items():
        print(f"{name:<12}{t['stall_s']:>10.4f}{t['write_s']:>10.2f}{gb / t['write_s']:>8.2f}")
    print(f"write time encrypted / plain: {ckpt['encrypted']['write_s'] / ckpt['plain']['write_s']:.2f}")
    med = {k: statistics.median(v) for k, v in ingest_s.items()}
    print(f"\ningest of {mb:.1f} MB (median of {args.repeats})")
    for name, s in med.items():
        print(f"{name:<12}{s:>8.2f} s {mb / s:>8.2f} MB/s")
    print(f"ingest throughput encrypted / plain: {med['plain'] / med['encrypted']:.2f}")
    ray_tls = ray_tls_rows(str(root / "corpus"), str(root)) if args.ray_tls else None
    if ray_tls:
        print("\nRay's TLS, two-node cluster, 2 workers (one per node)")
        print(f"{'':<8}{'step s':>10}{'restart s':>11}{'recovered s':>13}")
        for name, row in ray_tls.items():
            print(f"{name:<8}{row['step_s']:>10.3f}{row['restart_s']:>11.2f}{row['recovered_s']:>13.2f}")
        print(f"step time tls / plain: {ray_tls['tls']['step_s'] / ray_tls['plain']['step_s']:.2f}")
    write_results(
        "security",
        {
            "args": vars(args),
            "loader_samples_per_s": loader,  # per dataset cut, per reader: every repeat
            "loader_shards": shards,
            "loader_pair_ratios": pairs,
            "loader_ratio": statistics.median(pairs["many shards"]),
            "loader_ratio_one_window": statistics.median(pairs["3 shards"]),
            "pyarrow_encrypted_samples_per_s": peer,
            "loader_goal": 0.70,
            "checkpoint_gb": gb,
            "checkpoint": ckpt,
            "checkpoint_write_ratio": ckpt["encrypted"]["write_s"] / ckpt["plain"]["write_s"],
            "ingest_mb": mb,
            "ingest_s": med,
            "ingest_ratio": med["plain"] / med["encrypted"],
            "ray_tls": ray_tls,
        },
    )


if __name__ == "__main__":
    main()
