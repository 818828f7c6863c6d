"""What a Ray Train worker group does when the link to one of its nodes is cut (fault 4).

A `TwoNodeCluster` (head + worker node in network namespaces, 1 CPU each), a
`TorchTrainer` with 2 gloo workers (one per node) whose loop all-reduces a tensor every
~50 ms. Once both ranks are stepping, the link is cut and we time, from the cut:

- `fixed`:   num_workers=2, max_failures=0, TorchConfig timeout_s at its 1800 s default:
             when `trainer.fit()` raises, and with what;
- `timeout`: the same with TorchConfig(timeout_s=10): does the collective timeout matter?
- `elastic`: num_workers=(1, 2), FailureConfig(max_failures=1): when the survivors step
             again at world size 1, and whether fit() then finishes;
- `elastic10`: the same with RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=10 (default 60).

Needs root (network namespaces). Run:

    .venv/bin/python benchmarks/partition_train.py [--scenarios fixed,timeout,elastic]

Prints a table and writes benchmarks/results/partition_train.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "partition_train.json"
SCENARIOS = {
    "fixed": {"num_workers": 2, "max_failures": 0, "timeout_s": 1800},
    "timeout": {"num_workers": 2, "max_failures": 0, "timeout_s": 10},
    "elastic": {"num_workers": [1, 2], "max_failures": 1, "timeout_s": 1800},
    # The first restart asks for 2 workers again (the lost node is still in the elastic policy's
    # resource view) and waits out the worker-group start timeout, 60 s by default.
    "elastic10": {"num_workers": [1, 2], "max_failures": 1, "timeout_s": 1800, "start_timeout_s": 10},
}
STEP_SLEEP_S = 0.05
WAIT_FOR_RAISE_S = 150.0


def train_loop(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    t = torch.ones(1024)
    for step in range(config["steps"]):
        dist.all_reduce(t)
        t.div_(world)
        if step % 10 == 0:
            with open(config["progress"], "a") as f:
                f.write(json.dumps({"rank": rank, "world": world, "step": step, "t": time.time()}) + "\n")
        time.sleep(STEP_SLEEP_S)


def driver(name: str, progress: str, storage: str) -> None:
    """Runs inside the head's namespace: fit once, report how it ended on stdout."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    spec = SCENARIOS[name]
    ray.init(logging_level="WARNING")
    workers = spec["num_workers"]
    trainer = TorchTrainer(
        train_loop,
        # elastic runs stop after ~100 steps at world size 1; the others never finish on their own
        train_loop_config={"progress": progress, "steps": 100 if isinstance(workers, list) else 1_000_000},
        torch_config=TorchConfig(backend="gloo", timeout_s=spec["timeout_s"]),
        scaling_config=ScalingConfig(
            num_workers=tuple(workers) if isinstance(workers, list) else workers, resources_per_worker={"CPU": 1}
        ),
        run_config=RunConfig(
            name=f"partition-{name}",
            storage_path=storage,
            failure_config=FailureConfig(max_failures=spec["max_failures"]),
        ),
    )
    try:
        trainer.fit()
        outcome = {"raised": None}
    except Exception as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        outcome = {"raised": type(e).__name__, "message": lines[:12]}
    print(json.dumps({"ended_at": time.time(), **outcome}), flush=True)


def progress_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_scenario(cluster, name: str) -> dict:
    progress = cluster.temp_root / f"progress-{name}.jsonl"
    storage = cluster.temp_root / "runs"
    argv = [sys.executable, __file__, "--driver", name, str(progress), str(storage)]
    env = {}
    if "start_timeout_s" in SCENARIOS[name]:  # Ray Train propagates it from the driver to its controller
        env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(SCENARIOS[name]["start_timeout_s"])
    proc = cluster.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len({p["rank"] for p in progress_lines(progress) if p["world"] == 2 and p["step"] >= 20}) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                raise RuntimeError(f"{name}: training never reached step 20 on both ranks:\n{out[-2000:]}{err[-3000:]}")
            time.sleep(0.2)
        cut_at = time.time()
        cluster.cut()
        out, err = proc.communicate(timeout=WAIT_FOR_RAISE_S)
        ended = json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {
            "scenario": name,
            **SCENARIOS[name],
            "ended_after_s": None,
            "raised": f"still running after {WAIT_FOR_RAISE_S:.0f} s",
        }
    except (json.JSONDecodeError, IndexError) as e:
        raise RuntimeError(f"{name}: driver gave no result ({e}):\n{err[-3000:]}") from e
    after = [p for p in progress_lines(progress) if p["t"] > cut_at]
    resumed = next((p for p in after if p["world"] == 1), None)
    return {
        "scenario": name,
        **SCENARIOS[name],
        "ended_after_s": round(ended["ended_at"] - cut_at, 1),
        "raised": ended["raised"],
        "message": ended.get("message"),
        "resumed_at_world_1_after_s": round(resumed["t"] - cut_at, 1) if resumed else None,
        "steps_at_world_1": max((p["step"] for p in after if p["world"] == 1), default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--keep-logs", action="store_true", help="keep the Ray temp dirs (/tmp/pt-PID-N)")
    args = parser.parse_args()

    from petatrain.chaos.netns import TwoNodeCluster

    rows = []
    with TwoNodeCluster(keep_logs=args.keep_logs) as cluster:
        print(f"two-node cluster up in {cluster.start_s:.1f} s")
        for i, name in enumerate(args.scenarios.split(",")):
            if i:
                cluster.restart_worker()
            rows.append(run_scenario(cluster, name))
            print(json.dumps(rows[-1]), flush=True)
        start_s = cluster.start_s

    print(f"\n{'scenario':<9} {'workers':<8} {'timeout_s':>9} {'fit ended after':>16} {'world 1 after':>14}  raised")
    for r in rows:
        ended = "-" if r["ended_after_s"] is None else f"{r['ended_after_s']:.1f} s"
        resumed = "-" if r.get("resumed_at_world_1_after_s") is None else f"{r['resumed_at_world_1_after_s']:.1f} s"
        print(
            f"{r['scenario']:<9} {r['num_workers']!s:<8} {r['timeout_s']:>9} {ended:>16} {resumed:>14}  {r['raised']}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    RESULTS.write_text(json.dumps({"machine": machine, "cluster_start_s": start_s, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--driver":
        driver(*sys.argv[2:])
    else:
        main()
