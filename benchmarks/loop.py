"""Model staleness under `petatrain loop` (issue 40, section 6): from a data version's commit to the
first response served by a model trained on it, and where the time goes.

The demo-scale loop on a local Ray: a synthetic corpus is the first version (the first model trained
from scratch, then served from `registry://bench@champion` with `--follow`); each cycle a new file of
`--increment` (1%) of the corpus lands in the source folder, and the loop, as `petatrain loop` runs it
(look, let the file settle, `api.loop_cycle`), appends it, continues the champion onto it (every new
row once, with replay), evaluates and promotes; the server swaps to the new version. A client asks
the server all along; the server measures staleness at its first answer of each version.

Side by side, the other way to keep a model current (cron + a training script, or KubeRay's
RayCronJob): retrain from scratch on the whole latest version, once over its rows, measured once
(the last version) and set in the same breakdown.

    .venv/bin/python benchmarks/loop.py               # ~6 minutes on 2 cores
    .venv/bin/python benchmarks/loop.py --cycles 3

Prints the per-cycle table and writes benchmarks/results/loop.json. Goal: staleness p50 <= 2 minutes
on this machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time

from _common import ROOT, WORK, write_results

sys.path.insert(0, str(ROOT / "src"))

SETTINGS = [
    "parallel.workers=1", "train.eval_every=0", "checkpoint.every=20", "ingest.tokenizer=bytes",
    "ingest.pack_length=65", "ingest.shard_size=200KB", "ingest.dedup=exact", "serve.follow_poll_s=1",
]  # fmt: skip


def _asker(url: str, seen: list[dict], stop: threading.Event) -> threading.Thread:
    """A client: a completion every 0.25 s, then what /v1/models says of the model that answered."""
    import requests

    def ask() -> None:
        while not stop.is_set():
            try:
                answer = requests.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
                card = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]
                seen.append({"at": time.time(), "status": answer.status_code, **card})
            except requests.RequestException as exc:
                seen.append({"at": time.time(), "status": 0, "error": str(exc)[:100]})
            stop.wait(0.25)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread


def _epoch(iso: str) -> float:
    from petatrain.data.manifest import epoch

    return float(epoch(iso) or 0.0)


def _first_served(seen: list[dict], version: int) -> float | None:
    """When the server first answered with a model trained on `version` (or a later one): the time
    its card reports (its data's commit + the staleness it measured at that first answer)."""
    times = [
        _epoch(s["data_committed"]) + s["staleness_s"]
        for s in seen
        if s.get("data_version") is not None and s["data_version"] >= version and s.get("staleness_s") is not None
    ]
    return min(times) if times else None


def _row(record: dict, seen: list[dict]) -> dict:
    """A cycle's breakdown. A version the gate refused is served once a later one is promoted: its
    staleness runs to that model's first answer."""
    served = _first_served(seen, record["version"])
    committed, promoted = _epoch(record["committed"]), _epoch(record["finished"])
    staleness = round(served - committed, 3) if served is not None else None
    return {
        "version": record["version"],
        "outcome": record["outcome"],
        "steps_trained": record["steps"],
        "wait_s": record["wait_s"],
        **{f"{k}_s": v for k, v in record["times"].items()},
        "swap_s": round(served - promoted, 3) if served is not None and record["outcome"] == "promoted" else None,
        "staleness_s": staleness,
        "landing_to_served_s": round(served - record["dropped"], 3) if served is not None else None,
    }


def _cycle(spec, watcher, dropped_at: float) -> dict:
    """One cycle as `petatrain loop` runs it: look; a file seen for the first time settles; cycle."""
    from petatrain import api

    look = watcher.look()
    while not look.ready:
        time.sleep(spec.watch.settle_s)
        look = watcher.look()
    started = time.time()
    done = api.loop_cycle(spec, [f.url for f in look.ready])
    return {**done.record, "wait_s": round(started - dropped_at, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--documents", type=int, default=1000, help="documents of the first version")
    parser.add_argument("--increment", type=float, default=0.01, help="each cycle's new data, of the first")
    parser.add_argument("--first-steps", type=int, default=40)
    args = parser.parse_args()

    from petatrain import api
    from petatrain.data import synth
    from petatrain.data.index import open_dataset
    from petatrain.loop import spec as spec_mod
    from petatrain.loop.watch import Watcher
    from petatrain.runtime.cluster import init_ray

    work = WORK / "loop"
    shutil.rmtree(work, ignore_errors=True)
    incoming = work / "incoming"
    synth.generate(str(incoming / "v1"), documents=args.documents, files=4, bad_records=False, seed=1)
    loop_file = work / "loop.yaml"
    import yaml

    loop_file.write_text(
        yaml.safe_dump(
            {
                "model": "bench",
                "job": str(ROOT / "examples" / "tiny.yaml"),
                "set": SETTINGS,
                "source": str(incoming),
                "dataset": str(work / "data"),
                "runs": str(work / "runs"),
                "registry": str(work / "registry"),
                "steps": args.first_steps,
                "watch": {"poll_s": 1, "settle_s": 1},
            }
        )
    )
    spec = spec_mod.load(loop_file)
    init_ray("", local_cpus=2)
    watcher = Watcher(spec.source, spec.dataset)
    first = _cycle(spec, watcher, time.time())
    print(f"v1: {first['outcome']} ({first['steps']} steps from scratch)")
    serving = api.serve(
        "registry://bench@champion", follow=True, port=8031, registry=spec.registry,
        overrides=["serve.follow_poll_s=1", "serve.cpus_per_replica=0"],
    )  # fmt: skip
    seen: list[dict] = []
    stop = threading.Event()
    client = _asker(serving.url, seen, stop)
    records: list[dict] = []
    try:
        for k in range(args.cycles):
            extra = max(1, round(args.documents * args.increment))
            dropped = time.time()
            synth.generate(str(incoming / f"inc-{k + 2}"), documents=extra, files=1, bad_records=False, seed=100 + k)
            record = _cycle(spec, watcher, dropped)
            if record["outcome"] == "promoted":  # wait for the server's first answer with it
                deadline = time.time() + 120
                while time.time() < deadline and _first_served(seen, record["version"]) is None:
                    time.sleep(0.2)
            records.append({**record, "dropped": dropped})
        rows = [_row(r, seen) for r in records]
        for row in rows:
            print(row)
        # The other way: retrain from scratch on the whole latest version, once over its rows.
        latest = open_dataset(spec.dataset).manifest
        job = spec.job_config()
        samples = latest.totals.rows
        steps = max(1, samples // job.train.global_batch)
        began = time.perf_counter()
        from petatrain import config as config_mod

        retrain_cfg = config_mod.load(
            spec.job or None, [*spec.set, f"data.dataset={spec.dataset}", f"train.steps={steps}"]
        )
        api.train(retrain_cfg, run_dir=str(work / "retrain"))
        retrain_s = round(time.perf_counter() - began, 3)
    finally:
        stop.set()
        client.join(timeout=60)
        api.stop_serving()
    failed = [s for s in seen if s["status"] != 200]
    served = [r["staleness_s"] for r in rows if r["staleness_s"] is not None]
    p50 = statistics.median(served) if served else None
    mean = {key: round(statistics.mean(r[key] for r in rows if r.get(key) is not None), 2) for key in
            ("wait_s", "ingest_s", "train_s", "promote_s", "swap_s")}  # fmt: skip
    retrain_staleness = round(mean["ingest_s"] + retrain_s + mean["promote_s"] + mean["swap_s"], 2)
    print()
    print("| version | step | wait | ingest | train | evaluate+promote | swap | staleness | landing to served |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}s"

    for r in rows:
        cells = [r[k] for k in ("wait_s", "ingest_s", "train_s", "promote_s", "swap_s", "staleness_s")]
        print(
            f"| v{r['version']} ({r['outcome']}) | {r['steps_trained']} | {' | '.join(map(shown, cells))} | "
            f"{shown(r['landing_to_served_s'])} |"
        )
    print()
    print("| keeping current | train | staleness (p50 / estimate) | vs continue |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| petatrain loop (continue, each new row once) | {mean['train_s']:.1f}s | {p50:.1f}s | 1.00 |")
    print(
        f"| retrain from scratch, once over v{latest.generation} ({steps} steps) | {retrain_s:.1f}s | "
        f"{retrain_staleness:.1f}s | {retrain_staleness / p50:.2f} |"
    )
    print(f"\nrequests: {len(seen)}, failed: {len(failed)}; staleness p50 {p50:.1f}s (goal <= 120s)")
    write_results(
        "loop",
        {
            "cycles": rows,
            "staleness_p50_s": p50,
            "mean": mean,
            "requests": len(seen),
            "failed_requests": len(failed),
            "retrain": {
                "version": latest.generation,
                "steps": steps,
                "train_s": retrain_s,
                "staleness_estimate_s": retrain_staleness,
            },
            "settings": {
                "documents": args.documents,
                "increment": args.increment,
                "first_steps": args.first_steps,
                "set": SETTINGS,
            },
        },
    )


if __name__ == "__main__":
    main()
