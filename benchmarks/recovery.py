"""Recovery from a worker SIGKILL: petatrain vs Ray Train's own restart path.

Both train the same GPT (examples/tiny.yaml: 2 layers, d_model 64, seq 64, global batch 16,
micro-batch 8) on two CPU workers with gloo, checkpoint every 10 steps, and SIGKILL rank 1
at the end of step K (default 200: ~5 s into the attempt, so what an attempt prepares for
the next, spares and a warm controller, is up, as it would be minutes into a real one).
For every repetition, each in a fresh process with its own local Ray:

- **petatrain**: `petatrain train examples/tiny.yaml --inject kill@step=K,rank=1`; times from
  RUN/events.jsonl: fault_injected.t (just before the kill), failure.t (the supervisor has
  classified the failure), the first `step` event of the next attempt. As configured by
  default: Ray Train's controller runs in the driver, and once an attempt steps each node
  starts and imports the next attempt's worker processes at idle priority (spares,
  petatrain.runtime.startup.spares), in which the restart's ranks start; every rank process, spare
  or not, is forked from the node's fork server, which imported torch, TorchDynamo and Ray Train
  once (petatrain.runtime.startup.forkserver). A second row turns off the spares
  (`faults.spares: false`), another the fork server (`faults.forkserver: false`). Another runs
  the controller as Ray Train does, an actor
  (`PETATRAIN_CONTROLLER=actor`), with the warm standby that then starts the next
  attempt's controller once the attempt steps (`faults.standby: true`).
- **Ray Train**: a plain `TorchTrainer` with `FailureConfig(max_failures=1)` whose loop saves
  and loads its own checkpoint through `ray.train.report(checkpoint=...)` /
  `ray.train.get_checkpoint()` and kills rank 1 with SIGKILL at step K. The loop appends
  timestamps to a file; a `UserCallback.after_exception` on the controller stamps the moment
  Ray Train sees the failure. Run with Ray Train's defaults (health check every 2 s) and
  with the 0.5 s interval petatrain sets.

detection = kill -> failure detected; restart = detected -> first step completed after the
resume; total = their sum (the target: <= 30 s). For petatrain, "run CPU s" is the machine's CPU
time (/proc/stat, every process) over the whole run, start to exit, and "run s" its wall time.
"back at K" is kill -> step K done again
(the steps lost since the last checkpoint are recomputed). The restart breakdown shows where
the time goes. The machine is shared and small, so every figure is the median of the
repetitions, with min-max.

    .venv/bin/python benchmarks/recovery.py [--reps 3] [--kill-step 200] [--petatrain-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import write_results  # benchmarks/ is not a package

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / ".work" / "recovery"
TINY = ROOT / "examples" / "tiny.yaml"
# examples/tiny.yaml, spelled out for the Ray Train loop.
MODEL = {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 320, "seq_len": 64}
MICRO, GLOBAL, LR, CKPT_EVERY = 8, 16, 3e-3, 10


def dataset() -> str:
    """A packed byte-token dataset like tests/conftest.py's token_dataset's (rows of 65 tokens)."""
    from petatrain import api, config
    from petatrain.data import synth

    out = WORK / "ds"
    if not (out / "_index" / "manifest.json").exists():
        shutil.rmtree(WORK, ignore_errors=True)
        synth.generate(str(WORK / "corpus"), documents=2000, files=2)
        cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="150KB", dedup="exact")
        api.ingest([str(WORK / "corpus")], str(out), config=cfg)
    return str(out)  # absolute: Ray workers do not run in this directory


# -- petatrain -------------------------------------------------------------------------------


def run_petatrain(
    ds: str,
    steps: int,
    kill_step: int,
    rep: int,
    *,
    spares: bool = True,
    forkserver: bool = True,
    controller: str = "driver",
) -> dict:
    run_dir = WORK / f"petatrain-run-{controller}-{spares}-{forkserver}-{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"data.dataset={ds}", f"train.steps={steps}", f"checkpoint.every={CKPT_EVERY}", "train.eval_every=0"]
    sets += [f"faults.spares={str(spares).lower()}", f"faults.forkserver={str(forkserver).lower()}"]
    cmd = [sys.executable, "-m", "petatrain", "train", str(TINY), "--run-dir", str(run_dir), "--json"]
    cmd += [arg for s in sets for arg in ("--set", s)] + ["--inject", f"kill@step={kill_step},rank=1"]
    load = os.getloadavg()[0]
    env = {**os.environ, "PETATRAIN_CONTROLLER": controller}
    cpu, wall = _machine_cpu_s(), time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, env=env)
    cpu, wall = _machine_cpu_s() - cpu, time.time() - wall
    if result.returncode != 0:
        raise SystemExit(f"petatrain train failed:\n{result.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]

    def first(kind: str, attempt: int | None = None, **match) -> dict:
        return _first(events, kind, attempt, **match)

    killed = first("fault_injected")
    failure = first("failure", 0)
    resumed = first("resume", 1)
    step1 = first("step", 1)
    ranks = [e for e in events if e["event"] == "worker_start" and e["attempt"] == 1]
    starts = [e["t"] for e in ranks]
    begun = first("attempt_start", 1)["t"]
    row = _row(
        kill=killed["t"],
        detected=failure["t"],
        first_step=step1["t"],
        back_at_k=first("step", 1, step=kill_step)["t"],
        steps_lost=kill_step - resumed["step"],
        cause=failure["cause"],
        load=load,
        in_spares=sum(1 for e in ranks if (e.get("warm_up") or {}).get("started", begun) < begun),
        breakdown={
            "failure -> attempt_start": begun - failure["t"],
            "attempt_start -> all workers started": max(starts) - begun,
            "workers started -> resumed (model, data, checkpoint read)": resumed["t"] - max(starts),
            "resumed -> first step done": step1["t"] - resumed["t"],
        },
    )
    return row | {"run_cpu_s": round(cpu, 1), "run_s": round(wall, 1)}


def _first(events: list[dict], kind: str, attempt: int | None = None, **match) -> dict:
    """The first event of a kind (in an attempt, with matching fields)."""
    return next(
        e
        for e in events
        if e["event"] == kind
        and (attempt is None or e.get("attempt") == attempt)
        and all(e.get(k) == v for k, v in match.items())
    )


def _row(*, kill, detected, first_step, back_at_k, steps_lost, cause, load, breakdown, in_spares=None) -> dict:
    return {
        "ranks_started_in_spares": in_spares,
        "detection_s": detected - kill,
        "restart_s": first_step - detected,
        "total_s": first_step - kill,
        "back_at_k_s": back_at_k - kill,
        "steps_lost": steps_lost,
        "cause": cause,
        "load_avg_1m": round(load, 2),
        "restart_breakdown_s": {k: round(v, 3) for k, v in breakdown.items()},
    }


# -- Ray Train's own restart path ------------------------------------------------------------


def _stamp(path: str, **fields) -> None:
    with open(path, "a") as f:  # one short O_APPEND write per line: safe across processes
        f.write(json.dumps({"t": time.time(), **fields}) + "\n")


def ray_train_loop(config: dict) -> None:
    """Same model, batch and optimizer as tiny.yaml; random tokens; its own checkpoints."""
    started = time.time()
    import tempfile

    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from petatrain.config import ModelConfig
    from petatrain.models.gpt import GPT, next_token_loss

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    stamps, kill_step = config["stamps"], config["kill_step"]
    checkpoint = ray.train.get_checkpoint()
    attempt = 0 if checkpoint is None else 1
    _stamp(stamps, event="worker_start", rank=rank, attempt=attempt, fn_start=started)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(ModelConfig(**MODEL)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    step = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    if rank == 0:
        _stamp(stamps, event="resume", attempt=attempt, step=step)
    accum = GLOBAL // world // MICRO
    while step < config["steps"]:
        gen = torch.Generator().manual_seed(step * world + rank)
        for _ in range(accum):
            tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=gen)
            (next_token_loss(model, tokens) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0:
            _stamp(stamps, event="step", attempt=attempt, step=step)
        if rank == 1 and attempt == 0 and step == kill_step:
            _wait_for_registered_checkpoint(stamps)
            _stamp(stamps, event="kill", attempt=attempt, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % CKPT_EVERY == 0:
            with tempfile.TemporaryDirectory() as folder:
                saved = None
                if rank == 0:
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                    torch.save(state, os.path.join(folder, "state.pt"))
                    saved = ray.train.Checkpoint.from_directory(folder)
                ray.train.report({"step": step}, checkpoint=saved)


def _wait_for_registered_checkpoint(stamps: str, timeout_s: float = 60.0) -> None:
    """Hold the kill until the controller has the last checkpoint.

    `ray.train.report` returns once the report is queued; the controller takes it at its
    next poll (every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S). A kill before that loses the
    checkpoint and the restart begins at step 0: with steps of milliseconds that race is
    an artefact of the tiny model, so the benchmark waits it out before killing.
    """
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(stamps) as f:
            if any('"checkpoint_registered"' in line for line in f):
                return
        time.sleep(0.05)
    raise TimeoutError("the controller never registered a checkpoint")


def ray_train_child(stamps: str, storage: str, steps: int, kill_step: int) -> None:
    """Runs in its own process (a fresh local Ray, as `petatrain train` has)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, UserCallback
    from ray.train.torch import TorchConfig, TorchTrainer

    class ControllerStamps(UserCallback):
        """Runs on the controller: stamps registered checkpoints and the moment a worker error is seen."""

        def after_report(self, run_context, metrics, checkpoint) -> None:
            if checkpoint is not None:
                _stamp(stamps, event="checkpoint_registered", step=metrics[0]["step"])

        def after_exception(self, run_context, worker_exceptions) -> None:
            _stamp(stamps, event="failure", ranks=sorted(worker_exceptions))  # every poll: the first counts

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(include_dashboard=False, logging_level="WARNING")
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"stamps": stamps, "steps": steps, "kill_step": kill_step},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=f"recovery-{os.getpid()}",
            storage_path=storage,
            failure_config=FailureConfig(max_failures=1),
            callbacks=[ControllerStamps()],
        ),
    )
    trainer.fit()


def run_ray_train(steps: int, kill_step: int, rep: int, health_check_s: float | None) -> dict:
    stamps = WORK / f"ray-train-stamps-{rep}.jsonl"
    storage = WORK / f"ray-train-storage-{rep}"
    stamps.unlink(missing_ok=True)
    shutil.rmtree(storage, ignore_errors=True)
    env = dict(os.environ)
    env.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
    if health_check_s is not None:
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(health_check_s)
    cmd = [sys.executable, __file__, "--ray-train-child", str(stamps), str(storage), str(steps), str(kill_step)]
    load = os.getloadavg()[0]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"Ray Train run failed:\n{result.stderr[-3000:]}")
    events = [json.loads(line) for line in stamps.read_text().splitlines() if line.strip()]

    def first(kind: str, attempt: int | None = None, **match) -> dict:
        return _first(events, kind, attempt, **match)

    failure = first("failure")
    resumed = first("resume", 1)
    step1 = first("step", 1)
    starts = [e["t"] for e in events if e["event"] == "worker_start" and e["attempt"] == 1]
    return _row(
        kill=first("kill")["t"],
        detected=failure["t"],
        first_step=step1["t"],
        back_at_k=first("step", 1, step=kill_step)["t"],
        steps_lost=kill_step - resumed["step"],
        cause="worker error " + str(failure["ranks"]),
        load=load,
        breakdown={
            "failure -> all workers started": max(starts) - failure["t"],
            "workers started -> resumed (model, checkpoint read)": resumed["t"] - max(starts),
            "resumed -> first step done": step1["t"] - resumed["t"],
        },
    )


def _machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


# -- report -------------------------------------------------------------------------------


def summarise(rows: list[dict]) -> dict:
    out = {}
    for key in ("detection_s", "restart_s", "total_s", "back_at_k_s", "steps_lost", "run_cpu_s", "run_s"):
        if key not in rows[0]:
            continue  # Ray Train's rows: no whole-run figures
        values = [r[key] for r in rows]
        out[key] = {
            "median": round(statistics.median(values), 2),
            "min": round(min(values), 2),
            "max": round(max(values), 2),
        }
    if rows[0].get("ranks_started_in_spares") is not None:  # petatrain's rows: per repetition
        out["ranks_started_in_spares"] = [r["ranks_started_in_spares"] for r in rows]
    parts = rows[0]["restart_breakdown_s"]
    out["restart_breakdown_s"] = {
        part: round(statistics.median(r["restart_breakdown_s"][part] for r in rows), 2) for part in parts
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=200)
    parser.add_argument("--steps", type=int, default=215)
    parser.add_argument("--petatrain-only", action="store_true", help="skip the Ray Train peers")
    parser.add_argument("--ray-train-child", nargs=4, metavar=("STAMPS", "STORAGE", "STEPS", "KILL_STEP"))
    args = parser.parse_args()
    if args.ray_train_child:
        stamps, storage, steps, kill_step = args.ray_train_child
        ray_train_child(stamps, storage, int(steps), int(kill_step))
        return

    ds = dataset()
    runs = {
        "petatrain": lambda rep: run_petatrain(ds, args.steps, args.kill_step, rep),
        "petatrain, no spares": lambda rep: run_petatrain(ds, args.steps, args.kill_step, rep, spares=False),
        "petatrain, no fork server": lambda rep: run_petatrain(ds, args.steps, args.kill_step, rep, forkserver=False),
        "petatrain, controller actor + standby": lambda rep: run_petatrain(
            ds, args.steps, args.kill_step, rep, controller="actor"
        ),
        "Ray Train, defaults (health check 2 s)": lambda rep: run_ray_train(args.steps, args.kill_step, rep, None),
        "Ray Train, health check 0.5 s": lambda rep: run_ray_train(args.steps, args.kill_step, rep, 0.5),
    }
    if args.petatrain_only:
        runs = {name: fn for name, fn in runs.items() if name.startswith("petatrain")}
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for rep in range(args.reps):  # interleaved, so a burst of load from others hits every system
        for name, fn in runs.items():
            row = fn(rep)
            rows[name].append(row)
            print(
                f"rep {rep} {name:<40} detection {row['detection_s']:5.2f}s  restart {row['restart_s']:5.2f}s  "
                f"total {row['total_s']:5.2f}s  (load {row['load_avg_1m']})",
                file=sys.stderr,
                flush=True,
            )
    summary = {name: summarise(r) for name, r in rows.items()}

    print(
        f"\nrecovery from SIGKILL of rank 1 at step {args.kill_step} (tiny GPT, 2 CPU workers, checkpoint every "
        f"{CKPT_EVERY} steps), {os.cpu_count()} cores shared with other users: median of {args.reps} (min-max)\n"
    )
    print(f"{'run':<40} {'detection s':>17} {'restart s':>17} {'total s':>17} {'back at K s':>17} {'lost':>5}")

    def cell(stat: dict) -> str:
        return f"{stat['median']:.1f} ({stat['min']:.1f}-{stat['max']:.1f})"

    for name, s in summary.items():
        print(
            f"{name:<40} {cell(s['detection_s']):>17} {cell(s['restart_s']):>17} {cell(s['total_s']):>17} "
            f"{cell(s['back_at_k_s']):>17} {s['steps_lost']['median']:>5.0f}"
        )
    print(f"\n{'whole run (petatrain)':<40} {'run CPU s':>17} {'run s':>17}")
    for name, s in summary.items():
        if "run_cpu_s" in s:
            print(f"{name:<40} {cell(s['run_cpu_s']):>17} {cell(s['run_s']):>17}")
    for name, s in summary.items():
        print(f"\nrestart breakdown, {name} (median s):")
        for part, seconds in s["restart_breakdown_s"].items():
            print(f"  {part:<60} {seconds:6.2f}")
        if "ranks_started_in_spares" in s:
            print(f"  ranks of the next attempt that started in spares, per repetition: {s['ranks_started_in_spares']}")
    target = summary["petatrain"]["total_s"]["median"] <= 30
    print(f"\ntarget (kill -> first step after recovery <= 30 s): {'met' if target else 'NOT met'}")
    print("noise: 2 shared cores (load averages per run are in the JSON); compare medians, not single runs")
    write_results(
        "recovery",
        {
            "setup": {
                "model": MODEL,
                "global_batch": GLOBAL,
                "micro_batch": MICRO,
                "workers": 2,
                "checkpoint_every_steps": CKPT_EVERY,
                "kill_step": args.kill_step,
                "steps": args.steps,
                "reps": args.reps,
            },
            "summary": summary,
            "runs": rows,
            "target_met": target,
        },
    )


if __name__ == "__main__":
    main()
