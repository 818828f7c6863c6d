"""Model staleness under `petatrain loop` (issue 40, section 6): from a data version's commit to the
first response served by a model trained on it, and where the time goes.

The demo-scale loop on a local Ray: a synthetic corpus is the first version (the first model trained
from scratch, then served from `registry://bench@champion` with `--follow`); each cycle a new file of
`--increment` (1%) of the corpus lands in the source folder, and the loop, as `petatrain loop` runs it
(look, let the file settle, `api.loop_cycle`), appends it, continues the champion onto it (every new
row once, with replay), evaluates and promotes; the server swaps to the new version. A client asks
the server all along; the server measures staleness at its first answer of each version.

Side by side:
- the same cycles run by Airflow 3 (`petatrain.airflow`'s two DAGs on a real Airflow, started from
  its own environment by `tests/airflow/airflow.sh`): each new file triggers the ingest DAG at once
  (as a sensor would; a schedule adds up to its interval), the training DAG runs on the dataset's
  asset event, each task `petatrain loop --once --only STEP` in a process of its own; the server
  follows the same champion. Its staleness is split into the tasks' own times and what Airflow adds
  between them (scheduling, each task's process and its local Ray);
- the other way to keep a model current (cron + a training script, or KubeRay's RayCronJob):
  retrain from scratch on the whole latest version, once over its rows, measured once (the last
  version) and set in the same breakdown.

    .venv/bin/python benchmarks/loop.py               # ~11 minutes on 2 cores (Airflow's ~5)
    .venv/bin/python benchmarks/loop.py --cycles 3 --no-airflow

Prints the per-cycle table and writes benchmarks/results/loop.json. Goal: staleness p50 <= 2 minutes
on this machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

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


def _airflow_cycles(
    cycles: int, extra: int, loop_file: Path, incoming: Path, spec, seen: list[dict], work: Path
) -> list[dict]:
    """The cycles with Airflow as the orchestrator; one row per version: staleness and where it went."""
    import json
    import socket
    import subprocess

    import requests

    from petatrain.data import synth
    from petatrain.data.index import open_dataset, split_version
    from petatrain.registry.store import Registry

    dataset, registry = spec.dataset, Registry(spec.registry)

    def champion_data_version() -> int:
        """The data version the served champion was trained on (a version the gate refused is not)."""
        alias = registry.alias(spec.model)
        record = registry.record(spec.model, alias["version"]) if alias else {}
        return split_version(str(record.get("dataset") or ""))[1] or 0

    script, home = ROOT / "tests" / "airflow" / "airflow.sh", work / "airflow"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "loop_dags.py").write_text(
        "import datetime\nfrom petatrain.airflow import continuous_dags\n"
        f"continuous_dags({str(loop_file)!r}, schedule=None, retry_delay=datetime.timedelta(seconds=1))\n"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PETATRAIN_BIN": str(Path(sys.executable).with_name("petatrain"))}  # the tasks' CLI
    env.pop("RAY_ADDRESS", None)  # each task starts its own local Ray, as on an Airflow worker
    command = ["bash", str(script), "start", str(port), str(home)]
    started = subprocess.run(command, capture_output=True, text=True, env=env)
    if started.returncode != 0:
        raise SystemExit(f"Airflow did not start: {started.stderr[-2000:]}")
    url = started.stdout.strip()
    try:
        passwords = json.loads(next(home.glob("simple_auth_manager_passwords.json*")).read_text())
        user, password = next(iter(passwords.items()))
        token = requests.post(f"{url}/auth/token", json={"username": user, "password": password}, timeout=30)
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {token.json()['access_token']}"

        def until(check, timeout_s: float):
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if found := check():
                    return found
                time.sleep(0.5)
            raise SystemExit(f"Airflow: timed out; see {home / 'run'}")

        for dag in ("petatrain_ingest", "petatrain_train"):
            until(lambda d=dag: api.get(f"{url}/api/v2/dags/{d}", timeout=30).ok, 180)
            api.patch(f"{url}/api/v2/dags/{dag}", json={"is_paused": False}, timeout=30).raise_for_status()

        def runs(dag: str) -> list[dict]:
            listed = api.get(f"{url}/api/v2/dags/{dag}/dagRuns", timeout=30).json()["dag_runs"]
            done = [r for r in listed if r["state"] in ("success", "failed")]
            return sorted(done, key=lambda r: r.get("start_date") or "")

        def tasks(dag: str, run: dict) -> dict[str, float]:
            path = f"{url}/api/v2/dags/{dag}/dagRuns/{run['dag_run_id']}/taskInstances"
            return {t["task_id"]: _epoch_iso(t["end_date"]) - _epoch_iso(t["start_date"])
                    for t in api.get(path, timeout=30).json()["task_instances"] if t["start_date"]}  # fmt: skip

        rows = []
        for k in range(cycles):
            trained_before = len(runs("petatrain_train"))
            dropped = time.time()
            synth.generate(str(incoming / f"af-{k}"), documents=extra, files=1, bad_records=False, seed=500 + k)
            api.post(f"{url}/api/v2/dags/petatrain_ingest/dagRuns", json={"logical_date": None}, timeout=30)
            until(lambda n=trained_before: len(runs("petatrain_train")) > n, 900)
            manifest = open_dataset(dataset).manifest
            version, committed = manifest.generation, _epoch(manifest.updated)
            promoted = champion_data_version() >= version
            deadline = time.time() + (120 if promoted else 0)  # a refused version is served with a later one
            while time.time() < deadline and _first_served(seen, version) is None:
                time.sleep(0.2)
            spent = {**tasks("petatrain_ingest", runs("petatrain_ingest")[-1]),
                     **tasks("petatrain_train", runs("petatrain_train")[-1])}  # fmt: skip
            rows.append({
                "version": version, "outcome": "promoted" if promoted else "refused",
                **{f"{t}_task_s": round(v, 3) for t, v in spent.items()}, "committed": committed, "dropped": dropped,
            })  # fmt: skip
            print(rows[-1])
        for row in rows:  # a refused version is served with a later one: its staleness runs to that answer
            served, committed, dropped = _first_served(seen, row["version"]), row.pop("committed"), row.pop("dropped")
            landing = round(served - dropped, 3) if served is not None else None
            tasks_s = sum(v for k, v in row.items() if k.endswith("_task_s"))
            row["staleness_s"] = round(served - committed, 3) if served is not None else None
            row["landing_to_served_s"], row["between_tasks_s"] = landing, None
            if landing is not None and row["outcome"] == "promoted":
                row["between_tasks_s"] = round(landing - tasks_s, 3)
        return rows
    finally:
        subprocess.run(["bash", str(script), "stop", str(home)], capture_output=True, timeout=120)


def _epoch_iso(iso: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--documents", type=int, default=1000, help="documents of the first version")
    parser.add_argument("--increment", type=float, default=0.01, help="each cycle's new data, of the first")
    parser.add_argument("--first-steps", type=int, default=40)
    parser.add_argument("--no-airflow", action="store_true", help="leave out the Airflow side")
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
    extra = max(1, round(args.documents * args.increment))  # each cycle's new documents
    try:
        for k in range(args.cycles):
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
        airflow = [] if args.no_airflow else _airflow_cycles(args.cycles, extra, loop_file, incoming, spec, seen, work)
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
    airflow_p50 = None
    if airflow:
        airflow_p50 = statistics.median(r["staleness_s"] for r in airflow if r["staleness_s"] is not None)
        print("\n| Airflow: version | ingest task | train task | promote task | around the tasks | staleness |", end="")
        print(" landing to served |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        keys = ("ingest_task_s", "train_task_s", "promote_task_s", "between_tasks_s", "staleness_s")
        for r in airflow:
            print(
                f"| v{r['version']} ({r['outcome']}) | {' | '.join(shown(r.get(k)) for k in keys)} | "
                f"{shown(r['landing_to_served_s'])} |"
            )
    print()
    print("| keeping current | train | staleness (p50 / estimate) | vs continue |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| petatrain loop (continue, each new row once) | {mean['train_s']:.1f}s | {p50:.1f}s | 1.00 |")
    if airflow:
        train_task = statistics.mean(r.get("train_task_s", 0.0) for r in airflow)
        print(f"| Airflow 3 DAGs (the same steps, a process each) | {train_task:.1f}s | {airflow_p50:.1f}s | "
              f"{airflow_p50 / p50:.2f} |")  # fmt: skip
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
            "airflow": {"cycles": airflow, "staleness_p50_s": airflow_p50},
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
