"""`train --resume`: a new driver on a run directory continues the run it holds.

What a RayJob retry, a lost head pod or a new cluster does: start `petatrain train` again on
the same run directory. Without `--resume` a folder holding a run is refused (one line, before
Ray starts); with it, a different config is refused naming the fields, a finished run is left
alone, and an interrupted one continues from its newest committed checkpoint and exact loader
position: one run id, the next attempt number, the lost driver recorded as a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, kinds, sha256, tiny, train_workers
from petatrain.errors import ConfigError
from petatrain.observe import goodput
from petatrain.observe.ledger import read_events

STEP = {"attempt": 0, "step_s": 0.1, "data_wait_s": 0.0, "loss": 1.0}  # a step event's other fields


def _ledger(run, cfg, *events: dict) -> None:
    """A run directory as a driver leaves it: its marker and a ledger starting with run_start."""
    from petatrain.train import run_dir

    run_dir.claim(str(run))
    lines = [{"t": 1.0, "event": "run_start", "run_id": "r1", "workers": [2, 2], "steps": 30, "config": cfg.to_dict()}]
    lines += [{"t": 2.0 + i, **e} for i, e in enumerate(events)]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the moment the driver would start Ray: what is refused is refused before it."""
    from petatrain.runtime import cluster

    def refuse(*args, **kwargs):
        raise ConnectionError("the driver went on to start Ray")

    monkeypatch.setattr(cluster, "init_ray", refuse)


def _job(cfg, run, resume: bool):
    from petatrain.runtime.driver import TrainJob

    return TrainJob(config=cfg, run_url=str(run), resume=resume)


def test_a_folder_holding_a_run_is_refused_without_resume(tmp_path, token_dataset, no_ray):
    from petatrain.runtime.driver import run

    cfg = tiny(token_dataset)
    started = {"event": "attempt_start", "attempt": 0, "world_size": 2}
    _ledger(tmp_path, cfg, started, {"event": "step", **STEP, "step": 7})
    with pytest.raises(ConfigError) as refused:
        run(_job(cfg, tmp_path, resume=False))
    assert str(refused.value) == (
        f"--run-dir {tmp_path} holds run r1 (interrupted at step 7, 1 attempt(s)): "
        "pass --resume to continue it, or give a new --run-dir"
    )


def test_resume_names_what_differs_and_accepts_a_longer_run(tmp_path, token_dataset, no_ray):
    from petatrain.runtime.driver import run

    _ledger(tmp_path, tiny(token_dataset), {"event": "attempt_start", "attempt": 0, "world_size": 2})
    with pytest.raises(ConfigError) as refused:
        run(_job(tiny(token_dataset, "train.lr=0.5", "model.d_model=48"), tmp_path, resume=True))
    message = str(refused.value)
    assert "model.d_model: 64 in the run, 48 here" in message and "train.lr:" in message, message
    assert "\n" not in message
    # How far it trains, on how many workers, and how it is watched may change: it goes on to Ray.
    with pytest.raises(ConnectionError, match="went on to start Ray"):
        longer = tiny(token_dataset, "train.steps=60", "parallel.workers=1-2", "faults.max_restarts=9")
        run(_job(longer, tmp_path, resume=True))


def test_a_finished_run_resumed_is_left_as_it_is(tmp_path, token_dataset, no_ray):
    from petatrain.runtime.driver import run

    cfg = tiny(token_dataset)
    _ledger(
        tmp_path, cfg,
        {"event": "attempt_start", "attempt": 0, "world_size": 2},
        {"event": "failure", "attempt": 0, "cause": "kill", "detail": "rank 1 died", "rank": 1},
        {"event": "attempt_start", "attempt": 1, "world_size": 2},
        {"event": "step", **STEP, "step": 30, "attempt": 1},
        {"event": "end", "status": "ok", "step": 30},
    )  # fmt: skip
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "COMMITTED").write_text("{}")  # its final weights are committed
    before = (tmp_path / "events.jsonl").read_bytes()
    result = run(_job(cfg, tmp_path, resume=True))
    assert (result.steps, result.attempts, [f.cause.value for f in result.failures]) == (30, 2, ["kill"])
    assert (tmp_path / "events.jsonl").read_bytes() == before


@pytest.mark.slow
@pytest.mark.chaos
def test_a_killed_driver_is_continued_by_a_new_one_with_the_same_weights(baseline, token_dataset, tmp_path, ray_local):
    """The driver is SIGKILLed (its head pod is lost) after a checkpoint; `train --resume` on the
    same run directory, as a RayJob retry runs it, ends with the uninterrupted run's weights. The
    kill is mid-run however fast the steps are: an injected hang freezes the rank after step 15
    (20 tiny steps take less than one look at the ledger), and fires once per run."""
    address = ray_local.get_runtime_context().gcs_address
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "petatrain", "train", str(ROOT / "examples" / "tiny.yaml"), "--run-dir", str(run_dir),
        "--address", address, "--resume", "--json",
        "--set", f"data.dataset={token_dataset}", "--set", "train.steps=30", "--set", "faults.hang_timeout_s=6",
        "--inject", "hang@step=15",
    ]  # fmt: skip
    first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and first.poll() is None:
            events = read_events(str(run_dir)) if (run_dir / "events.jsonl").exists() else []
            if any(e["event"] == "fault_injected" for e in events):
                break
            time.sleep(0.2)
        assert first.poll() is None, first.communicate()[1].decode()[-3000:]
        ranks = train_workers()
        os.killpg(first.pid, signal.SIGKILL)  # the driver and everything it started in its session
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # The ranks (on the session's Ray, not in the driver's session) may train on for a moment, until Ray
    # ends the dead driver's job, and commit another checkpoint whose events the hub (gone with the
    # driver, its ledger flushed every few seconds) never wrote: what the next driver finds is on storage.
    deadline = time.monotonic() + 60
    while ranks & train_workers():
        assert time.monotonic() < deadline, "the dead driver's ranks are still alive after 60 s"
        time.sleep(0.2)
    committed = sorted(int(p.parent.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("*/COMMITTED"))
    assert committed and committed[-1] < 30 and not (run_dir / "final").exists(), "the driver was killed mid-run"

    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["steps"] == 30
    assert sha256(run_dir / "final" / "model.safetensors") == sha256(baseline / "final" / "model.safetensors")

    names = kinds(run_dir)  # every line fits its schema
    assert names.count("run_start") == 1 and names.count("run_continue") == 1
    events = read_events(str(run_dir))
    cont = next(e for e in events if e["event"] == "run_continue")
    assert cont["run_id"] == events[0]["run_id"] and cont["previous"] == "interrupted"
    lost = next(e for e in events if e["event"] == "failure")
    assert (lost["cause"], lost["attempt"]) == ("driver_lost", cont["attempt"] - 1)
    resumed = next(e["step"] for e in events if e["event"] == "resume" and e["attempt"] == cont["attempt"])
    assert 10 <= resumed == committed[-1], "continued from the newest committed checkpoint"
    report = goodput.account(events)
    assert report.attempts == cont["attempt"] + 1 and [f.cause for f in report.faults] == ["driver_lost"]


@pytest.mark.slow
@pytest.mark.chaos
def test_a_run_is_pinned_to_its_dataset_version_and_a_failed_continuation_leaves_a_finished_run_as_it_was(
    tmp_path, ray_local
):
    """First contact, items 1-2. An append while a run trained made its next recovery fail for good
    (the loader refused the grown dataset, though the index the run started from was on disk): a
    run is pinned to the dataset version it started on and reopens exactly that. A `--resume` of a
    finished run that failed before training a step rewrote its record ("failed, 40/80 steps"):
    a finished run's record changes only once its continuation trains a step."""
    from petatrain import api
    from petatrain.config import IngestConfig
    from petatrain.data import index, synth
    from petatrain.data.ingest import IngestJob
    from petatrain.data.ingest import run as ingest
    from petatrain.errors import PetatrainError

    settings = IngestConfig(tokenizer="bytes", pack_length=65, shard_size="60KB", dedup="exact")
    synth.generate(str(tmp_path / "first"), documents=400, files=1, seed=1)
    ds = tmp_path / "ds"
    ingest(IngestJob(sources=[str(tmp_path / "first")], out=str(ds), config=settings))
    run = tmp_path / "run"
    cfg = tiny(str(ds), "parallel.workers=1", "train.steps=20", "checkpoint.every=5", "faults.max_restarts=0")
    with pytest.raises(PetatrainError):  # the run fails at step 12, its newest checkpoint at 10
        api.train(cfg, run_dir=str(run), injections=["kill@step=12,rank=0"])
    assert read_events(str(run))[0]["config"]["data"]["dataset"] == f"{ds}@v1"

    synth.generate(str(tmp_path / "second"), documents=300, files=1, seed=2)  # new data lands: version 2
    ingest(
        IngestJob(
            sources=[str(tmp_path / "first"), str(tmp_path / "second")], out=str(ds), config=settings, append=True
        )
    )
    assert index.read_manifest(str(ds)).generation == 2 and index.open_dataset(f"{ds}@v1").manifest.generation == 1
    resumed = api.train(cfg, run_dir=str(run), resume=True)  # a RayJob retry: same config, bare dataset URL
    assert resumed.steps == 20
    events = read_events(str(run))
    assert [e["step"] for e in events if e["event"] == "resume"][-1] == 10
    assert f"{ds}@v1" in (run / "config.yaml").read_text()

    # Told to read another version, a continuing run is refused in one line before anything starts.
    before = {name: (run / name).read_bytes() for name in ("events.jsonl", "config.yaml", "report.json")}
    with pytest.raises(ConfigError, match=r"data\.dataset: .*@v1' in the run, .*@v2' here"):
        api.train(tiny(f"{ds}@v2", "parallel.workers=1", "train.steps=30"), run_dir=str(run), resume=True)

    # The shards go missing: the continuation of the finished run fails before its first step,
    # and the run's record (ledger, config, report) is what it was.
    (ds / "data").rename(tmp_path / "away")
    more = tiny(str(ds), "parallel.workers=1", "train.steps=30", "checkpoint.every=5", "faults.max_restarts=0")
    with pytest.raises(PetatrainError):
        api.train(more, run_dir=str(run), resume=True)
    assert {name: (run / name).read_bytes() for name in before} == before
    assert api.report(str(run)).to_dict()["status"] == "ok"

    (tmp_path / "away").rename(ds / "data")
    longer = api.train(more, run_dir=str(run), resume=True)  # now it starts: the record says so
    assert longer.steps == 30
    events = read_events(str(run))
    assert events[-1]["event"] == "end" and events[-1]["status"] == "ok" and events[-1]["step"] == 30
    assert "steps: 30" in (run / "config.yaml").read_text()
