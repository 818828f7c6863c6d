"""Small helpers shared by the ingest tests."""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import NoReturn

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from petatrain import config
from petatrain.chaos.inject import parse
from petatrain.config import IngestConfig
from petatrain.data import index
from petatrain.data.ingest import IngestJob, run
from petatrain.observe.ledger import read_events
from petatrain.storage import read_bytes


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str) -> NoReturn:
    """A prerequisite of a test is missing (root, network namespaces, Java, the real CRDs): skipped on
    a developer's machine, a failure in CI (CI=true), where nothing may be skipped silently but the
    tests that need CUDA."""
    if in_ci():
        pytest.fail(f"a prerequisite is missing in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def need_network_namespaces() -> None:
    """Root and working network namespaces (iproute2 installed if only `ip` is missing), or `missing`."""
    import shutil
    import subprocess

    from petatrain.chaos.netns import netns_available

    if os.geteuid() != 0:
        missing("network-namespace tests need root")
    if shutil.which("ip") is None and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "iproute2"], capture_output=True)
    reason = netns_available()
    if reason is not None:
        missing(f"network namespaces unavailable: {reason}")


def ingest(sources, out, *, append=False, register=False, refresh=False, options=None, **cfg):
    return run(
        IngestJob(
            sources=list(sources),
            out=str(out),
            config=IngestConfig(**cfg),
            append=append,
            register=register,
            refresh=refresh,
            options=options,
        )
    )


def read_dataset(url, options=None) -> pa.Table:
    """All rows of a committed dataset, in shard order, read through its index."""
    ds = index.open_dataset(str(url), options)
    tables = [
        pq.read_table(pa.BufferReader(read_bytes(ds.shard_url(p), options)))
        for p in ds.shards.column("path").to_pylist()
    ]
    return pa.concat_tables(tables) if tables else pa.table({})


def rejects(url) -> pa.Table:
    files = sorted(glob.glob(os.path.join(str(url), "_rejects", "*", "records-*.parquet")))
    return pa.concat_tables([pq.read_table(f) for f in files]) if files else pa.table({})


def duplicates(url) -> pa.Table:
    files = sorted(glob.glob(os.path.join(str(url), "_rejects", "*", "duplicates-*.parquet")))
    return pa.concat_tables([pq.read_table(f) for f in files])


def snapshot(url) -> dict[str, bytes]:
    """Every file under a local dataset, by relative path."""
    out = {}
    for root, _, files in os.walk(str(url)):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, str(url))] = handle.read()
    return out


# -- training runs, shared by the train test files --------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def tiny(dataset: str, *overrides: str) -> config.JobConfig:
    return config.load(
        ROOT / "examples" / "tiny.yaml",
        [f"data.dataset={dataset}", "train.steps=30", "faults.hang_timeout_s=6", *overrides],
    )


def train(cfg, run_dir, *injections: str) -> dict:
    """A driver on `run_dir`, as `train --resume` runs one: it starts a new run, or continues the one there."""
    from petatrain.runtime.driver import TrainJob, run

    return run(TrainJob(config=cfg, run_url=str(run_dir), injections=[parse(i) for i in injections], resume=True))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kinds(run_dir) -> list[str]:
    """The kinds of a run's events, in order; every line must fit its schema (observe.events)."""
    from petatrain.observe import events

    lines = read_events(str(run_dir))
    for line in lines:
        assert "schema_error" not in line, line
        events.parse(line)
    return [e["event"] for e in lines]


def write_checkpoint(
    run: str, step: int, tensors: dict, *, options=None, world_size: int = 1, keep_last: int = 10, keep_every: int = 0
) -> None:
    """Commit a checkpoint of `tensors` (rank 0's; the other ranks write none) through the real
    CheckpointWriter, its hub faked in process, as the training loop records it."""
    from petatrain.train.checkpoint import CheckpointWriter, Snapshot

    parts: dict = {}
    writer = CheckpointWriter(
        run,
        options,
        report_part=lambda s, r, f: parts.__setitem__((s, r), f),
        wait_parts=lambda s, w, t: {n: i for (ps, _), f in parts.items() if ps == s for n, i in f.items()},
        on_commit=lambda info: None,
        keep_last=keep_last,
        keep_every=keep_every,
    )
    groups = [{"lr": 0.001, "weight_decay": 0.1, "params": ["w"]}]
    meta = {"loader": {"position": step}, "strategy": "ddp", "param_groups": groups, "config_digest": "0123abcd"}
    for rank in range(world_size):
        snap = Snapshot(step=step, rank=rank, world_size=world_size, tensors=tensors if rank == 0 else {}, meta=meta)
        writer.submit(snap)
        writer.wait()
    writer.close()
    assert writer.error is None, writer.error


# Runs in the head's namespace of a TwoNodeCluster: a job of 4 ranks (2 a node), the worker node's
# link cut at step 8, ended (checkpointed, with its final weights) through TrainJob.stop once the
# grown attempt has trained 5 steps, else when the time given is up, whatever attempt it is in.
_GROWING_DRIVER = """
import json, sys, threading, time
from petatrain import config
from petatrain.chaos.inject import parse
from petatrain.observe.ledger import read_events
from petatrain.runtime.driver import TrainJob, run
cfg = config.load(sys.argv[1], sys.argv[5:])
job = TrainJob(config=cfg, run_url=sys.argv[2], stop_after_s=float(sys.argv[3]), address=sys.argv[4],
               injections=[parse(f"partition@step=8,rank={r}") for r in range(4)], stop=threading.Event())

def stop_once_grown():
    while not job.stop.is_set():
        time.sleep(0.5)
        try:
            events = read_events(sys.argv[2])
        except Exception:
            continue
        resumed = [e["step"] for e in events if e["event"] == "resume" and e["attempt"] == 2]
        if resumed and any(e["event"] == "step" and e["attempt"] == 2 and e["step"] >= resumed[0] + 5 for e in events):
            job.stop.set()

threading.Thread(target=stop_once_grown, daemon=True).start()
print(json.dumps(run(job).to_dict()))
"""


def partitioned_and_grown_back(overrides: list[str], run_dir: Path) -> list[dict]:
    """A job of 4 ranks on two Ray nodes in network namespaces (2 a node, `overrides` say how they
    are laid out: 2 stages x 2 replicas, tensor-parallel pairs x 2 replicas). The worker node's link
    is cut at step 8: the node is lost in seconds and training goes on as the 2 ranks of the head
    node (parallel.workers 2-4). A fresh worker node joins: the driver sees room for 4 again, the
    ranks stop together after a checkpoint (no step lost) and 4 ranks resume from it; a few steps
    later the driver's program ends the run (TrainJob.stop). Checks all that; returns the ledger."""
    import json
    import subprocess
    import sys
    import time

    from petatrain.chaos.netns import TwoNodeCluster

    need_network_namespaces()
    overrides = [*overrides, "train.steps=100000", "parallel.workers=2-4", "resources.cpus_per_worker=0.5"]
    overrides += ["train.eval_every=0", "checkpoint.every=50"]
    argv = [sys.executable, "-c", _GROWING_DRIVER, str(ROOT / "examples" / "tiny.yaml"), str(run_dir), "240"]
    logs = run_dir.parent / f"{run_dir.name}-driver"
    logs.mkdir(parents=True)

    def so_far() -> list[dict]:
        return read_events(str(run_dir)) if (run_dir / "events.jsonl").exists() else []

    def attempts() -> list[dict]:
        return [e for e in so_far() if e["event"] == "attempt_start"]

    def shrunk_past_the_cut() -> bool:
        """The 2 ranks train beyond step 8: the grown job resumes after it, where no partition fires again."""
        return any(e["event"] == "step" and e["attempt"] == 1 and e["step"] > 8 for e in so_far())

    with TwoNodeCluster(head_cpus=1, worker_cpus=1) as cluster:
        out, err = (logs / "out.json").open("w"), (logs / "err.log").open("w")
        driver = cluster.popen([*argv, cluster.address, *overrides], stdout=out, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 90
            while not shrunk_past_the_cut() and driver.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert [a["world_size"] for a in attempts()] == [4, 2], (logs / "err.log").read_text()[-3000:]
            cluster.restart_worker()  # the node comes back while the 2 ranks train
            assert driver.wait(timeout=240) == 0, (logs / "err.log").read_text()[-3000:]
        except subprocess.TimeoutExpired:
            raise AssertionError((logs / "err.log").read_text()[-3000:]) from None
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    summary = json.loads((logs / "out.json").read_text())
    assert [f["cause"] for f in summary["failures"]] == ["node_lost", "resize"], summary["failures"]
    events = read_events(str(run_dir))
    assert [e["world_size"] for e in events if e["event"] == "attempt_start"] == [4, 2, 4]
    cut = next(e for e in events if e["event"] == "fault_injected")
    lost = next(e for e in events if e["event"] == "failure")
    assert lost["t"] - cut["t"] < 20, "the lost node is noticed in seconds, not the 30-minute collective timeout"
    steps = {a: [e["step"] for e in events if e["event"] == "step" and e["attempt"] == a] for a in (1, 2)}
    resumed = {e["attempt"]: e["step"] for e in events if e["event"] == "resume"}
    assert resumed[2] == steps[1][-1] > 8, "the resize's checkpoint is the step the ranks stopped at: no step lost"
    assert any(e["event"] == "step" and e["attempt"] == 2 and e["step"] > resumed[2] for e in events)
    assert events[-1]["event"] == "end" and events[-1]["status"] == "ok"
    # TrainJob.stop ended it, within a telemetry answer of being set (5 steps in), not the time cap
    assert resumed[2] + 5 <= events[-1]["step"] < resumed[2] + 200, (resumed, events[-1])
    assert (run_dir / "final" / "model.safetensors").exists()
    return events


class HealthProbe:
    """Asks the driver's /livez and /readyz on 127.0.0.1:`port` every 0.25 s with a real HTTP client
    while the `with` block runs (nothing answers before the driver serves, nor after); the answers
    are (monotonic time, path, status, body), in order."""

    def __init__(self, port: int):
        import threading

        self.port, self.seen = port, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._probe, daemon=True)

    def _probe(self) -> None:
        import time

        import requests

        while not self.done.is_set():
            for path in ("/livez", "/readyz"):
                try:
                    answer = requests.get(f"http://127.0.0.1:{self.port}{path}", timeout=2)
                    self.seen.append((time.monotonic(), path, answer.status_code, answer.json()))
                except requests.ConnectionError:
                    pass  # not serving yet, or no more
            self.done.wait(0.25)

    def __enter__(self) -> list[tuple[float, str, int, dict]]:
        self.thread.start()
        return self.seen

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def kill_first_tries(tmp_path: Path, ray) -> dict[str, str]:
    """The environment under which an orchestrator's tasks run `petatrain` (a loop of `_loop_file`'s
    folders) through `tests/kill_once.sh`: the first try of each loop step is SIGKILLed with all it
    started mid-way, its retry runs through; the steps killed are marked in `tmp_path/killed`. The
    ingest is killed once it has staged a file of the version (nothing committed), the training once
    an injected hang holds it after step 7 (its step-5 checkpoint committed), the promotion once it
    has written its cycle's record (promoted, its answer lost: the retry must not promote again). The
    tasks join the running Ray `ray` (the session's, through RAY_ADDRESS) as a scheduler's workers
    join their cluster: a killed try's Ray workers are the cluster's to end."""
    import sys

    (tmp_path / "killed").mkdir()
    return {
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", ""),
        "HOME": os.environ["HOME"],  # the token's default place, ~/.ray/auth_token
        "PETATRAIN_BIN": str(ROOT / "tests" / "kill_once.sh"),
        "PETATRAIN_REAL_BIN": str(Path(sys.executable).with_name("petatrain")),
        "PETATRAIN_KILL_DIR": str(tmp_path / "killed"),
        "PETATRAIN_KILL_ON_INGEST": f"{tmp_path}/data/_staging/*/docs/*",
        "PETATRAIN_KILL_ON_TRAIN": f"{tmp_path}/runs/v1-*/events.jsonl::fault_injected",
        "PETATRAIN_INJECT_TRAIN": "hang@step=7",
        "PETATRAIN_KILL_ON_PROMOTE": f"{tmp_path}/runs/_loop/cycles/*",
    }


def stopped_ray_processes() -> list[str]:
    """This machine's Ray processes stopped by a signal (state T): left behind, they never end."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (command := (entry / "cmdline").read_bytes()).startswith(b"ray::"):
                stat = (entry / "stat").read_text()
                if stat[stat.rindex(")") + 2] == "T":
                    found.append(f"{entry.name} {command.split(bytes(1))[0].decode()}")
        except OSError:  # ended meanwhile
            pass
    return found


def train_workers() -> set[int]:
    """Pids of this machine's Ray Train worker processes (Ray titles them `ray::RayTrainWorker...`)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                pids.add(int(entry.name))
        except OSError:  # ended meanwhile
            pass
    return pids


# -- ranks as local processes (gloo), for the layout and schedule comparisons --------------------
# Forked from one server that imported torch (and DTensor, TorchDynamo) once: a spawned rank paid
# ~2 s of CPU for those imports, and these tests start 20 of them.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch.nn.parallel", "helpers"]


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes, as torch.multiprocessing.start_processes runs it
    (an error in any rank is raised here), forked from a server holding torch's imports. The ranks
    get the environment the server started with (the first call's), not the caller's current one."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
