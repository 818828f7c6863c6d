"""`petatrain loop` (issue 40, section 4): new files in a source folder become a new dataset version,
the champion model is continued onto it, evaluated and promoted, by itself; every step idempotent,
so a loop killed anywhere and run again ends with one run and one model version per data version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, read_events
from petatrain.errors import ConfigError
from ray_head import free_ports

SETTINGS = [
    "parallel.workers=1", "train.eval_every=0", "train.warmup_steps=2", "checkpoint.every=5",
    "faults.hang_timeout_s=10", "ingest.tokenizer=bytes", "ingest.pack_length=65", "ingest.shard_size=20KB",
    "ingest.dedup=exact",
]  # fmt: skip


def _loop_file(tmp_path: Path, **extra) -> Path:
    values = {
        "model": "tiny",
        "job": str(ROOT / "examples" / "tiny.yaml"),
        "set": SETTINGS,
        "source": str(tmp_path / "incoming"),
        "dataset": str(tmp_path / "data"),
        "runs": str(tmp_path / "runs"),
        "registry": str(tmp_path / "registry"),
        "steps": 10,
        "watch": {"poll_s": 1, "settle_s": 0.5},
        **extra,
    }
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _one_version_one_run_one_model(tmp_path: Path) -> None:
    """What a loop (`_loop_file`'s) that took one new version to a model leaves, however often its steps
    were killed and retried: one run (resumed, not started over), one registered version, promoted."""
    from petatrain.registry.store import Registry

    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "_loop"]
    assert len(runs) == 1 and (runs[0] / "final" / "model.safetensors").exists()
    assert [e["event"] for e in read_events(str(runs[0]))].count("run_start") == 1
    registry = Registry(str(tmp_path / "registry"))
    assert registry.versions("tiny") == [1] and registry.alias("tiny")["version"] == 1
    (cycle,) = (tmp_path / "runs" / "_loop" / "cycles").iterdir()
    assert json.loads(cycle.read_text())["outcome"] == "promoted"


def _drop(folder: Path, name: str, documents: int, seed: int) -> None:
    from petatrain.data import synth

    synth.generate(str(folder / name), documents=documents, files=1, mean_words=60, bad_records=False, seed=seed)


def test_the_watcher_takes_a_file_once_it_is_stable_and_enough(tmp_path):
    """Two looks that agree make a file stable (one being written is left for later); a cycle waits
    for watch.min_bytes of stable new data, or for watch.max_wait_s since the oldest was seen."""
    from petatrain.loop.watch import Watcher

    source = tmp_path / "incoming"
    source.mkdir()
    now = [0.0]
    watcher = Watcher(str(source), str(tmp_path / "data"), clock=lambda: now[0])
    assert watcher.look().ready == [] and watcher.look().settling == []  # an empty folder is no error
    (source / "a.jsonl").write_text('{"text": "one"}\n')
    first = watcher.look()
    assert [Path(f.url).name for f in first.settling] == ["a.jsonl"] and first.ready == []
    with (source / "a.jsonl").open("a") as growing:  # still being written at the next look
        growing.write('{"text": "two"}\n')
    assert watcher.look().ready == []
    assert [Path(f.url).name for f in watcher.look().ready] == ["a.jsonl"]

    patient = Watcher(str(source), str(tmp_path / "data"), min_bytes=10**6, max_wait_s=60, clock=lambda: now[0])
    patient.look()
    now[0] = 30.0
    held = patient.look()
    assert held.stable and held.ready == [] and held.waited_s == 30.0  # too little new data, not long enough
    now[0] = 61.0
    assert patient.look().ready, "the oldest stable file waited watch.max_wait_s"
    with pytest.raises(Exception, match="source not found"):
        Watcher(str(tmp_path / "typo"), str(tmp_path / "data")).look()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"modle": "x"}, r"unknown config key 'modle' \(did you mean model\?\)"),
        ({"model": ""}, "loop: model is required"),
        ({"steps": -1}, "loop: steps must be >= 1"),
        ({"set": "train.lr=1"}, "loop: set is a list of KEY=VALUE"),
        ({"dataset": "/d@v3"}, "names a version"),
        ({"watch": {"poll_s": 0}}, "watch.poll_s must be > 0"),
        ({"watch": {"min_bytes": "lots"}}, "watch.min_bytes: cannot read size"),
        ({"set": ["train.stpes=3"]}, "unknown config key 'train.stpes'"),
    ],
)
def test_a_bad_loop_file_is_one_line(tmp_path, extra, match):
    from petatrain.loop import spec

    with pytest.raises(ConfigError, match=match):
        spec.load(_loop_file(tmp_path, **extra))


def test_a_store_down_past_its_retries_is_waited_out_not_the_end_of_the_loop(tmp_path, monkeypatch):
    """Issue 40, faults: the object store (or the registry on it) down beyond storage's own retries
    ended `petatrain loop`. The watching loop says so in one line and tries the cycle again after
    poll_s, doubling; `--once` (an orchestrator's task, which it retries) and an access denial still
    end it."""
    from petatrain import api
    from petatrain.cli import loop as loop_cli
    from petatrain.errors import AccessDeniedError, StorageAccessError
    from petatrain.loop import spec as spec_mod
    from petatrain.loop.watch import Watcher

    loop = spec_mod.load(_loop_file(tmp_path))
    (tmp_path / "incoming").mkdir()
    said, slept, calls = [], [], []
    outcomes = [StorageAccessError("s3://lake/registry: unreachable"), ConnectionError(), "done", KeyboardInterrupt()]

    def cycle(*args, **kwargs):
        calls.append(args)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return api.LoopCycle(outcome, 1)

    monkeypatch.setattr(api, "loop_cycle", cycle)
    monkeypatch.setattr(loop_cli, "say", said.append)
    monkeypatch.setattr(loop_cli.time, "sleep", slept.append)
    watcher = Watcher(loop.source, loop.dataset)
    with pytest.raises(KeyboardInterrupt):
        loop_cli._cycles(loop, watcher, "", once=False, as_json=True)
    assert len(calls) == 4 and slept == [1.0, 2.0, 1.0]  # poll_s 1: 1, 2, then the cycle's own poll
    assert "the cycle failed (s3://lake/registry: unreachable); trying again in 1s" in said[0]
    assert "the cycle failed (ConnectionError); trying again in 2s" in said[1]
    for once, error in ((True, StorageAccessError("down")), (False, AccessDeniedError("denied"))):
        outcomes[:] = [error]
        with pytest.raises(type(error)):
            loop_cli._cycles(loop, watcher, "", once=once, as_json=True)


@pytest.mark.slow
@pytest.mark.chaos
def test_the_loop_keeps_a_model_current_and_a_kill_anywhere_reruns_to_one_result(tmp_path, ray_local, request):
    """v1 from the first files (the loop killed mid-training, run again: the run resumes), v2 from a
    new file (killed after training, before its promotion: nothing trained again), v3 refused by
    the gate (the champion stays, the reason recorded, never trained again). The champion is served
    (registry://tiny@champion --follow) from v1 on: the served model's version moves to v2, and
    stays there when v3 is refused."""
    import calendar

    import requests

    from petatrain import api
    from petatrain.loop import records, spec
    from petatrain.loop.watch import Watcher
    from petatrain.registry.store import Registry

    source = tmp_path / "incoming"
    _drop(source, "a", 300, seed=3)
    loop_file = _loop_file(tmp_path)
    address = ray_local.get_runtime_context().gcs_address
    # The hang freezes the worker after step 9 (the step-5 checkpoint committed), so the kill below
    # is mid-training however fast the steps are: ten tiny steps take 0.15 s, less than one look at
    # the ledger. It fires once per run: the loop run again resumes without it.
    argv = [
        sys.executable, "-m", "petatrain", "loop", str(loop_file), "--once", "--json", "--address", address,
        "--inject", "hang@step=9",
    ]  # fmt: skip

    # -- cycle 1, through the CLI as a user runs it; SIGKILLed with its run frozen mid-way
    killed = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and killed.poll() is None:
            ledgers = list((tmp_path / "runs").glob("v1-*/events.jsonl"))
            if ledgers and any(e["event"] == "fault_injected" for e in read_events(str(ledgers[0].parent))):
                break
            time.sleep(0.2)
        assert killed.poll() is None, killed.communicate()[1].decode()[-3000:]
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the loop and everything it started in its session
        killed.wait()
    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    first = json.loads(again.stdout)
    assert (first["outcome"], first["version"], first["record"]["model_version"]) == ("promoted", 1, 1)
    assert first["ingested"] is None, "the files were committed before the kill: nothing to append again"
    run1 = first["record"]["run"]
    assert [p.name for p in (tmp_path / "runs").iterdir() if p.name != "_loop"] == [Path(run1).name]
    ledger = read_events(run1)
    assert [e["event"] for e in ledger].count("run_continue") == 1  # resumed, not started over
    assert [e["step"] for e in ledger if e["event"] == "resume"] == [0, 5]  # from the step-5 checkpoint

    # -- the champion served, following its alias, as a user serves it
    loop = spec.load(loop_file)
    fast = ["serve.follow_poll_s=0.5", "serve.cpus_per_replica=0"]
    port = free_ports(1)[0]
    serving = api.serve("registry://tiny@champion", follow=True, port=port, overrides=fast, registry=loop.registry)
    request.addfinalizer(api.stop_serving)

    def served(version: int, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            card = requests.get(f"{serving.url}/v1/models", timeout=30).json()["data"][0]
            if card["version"] == version or time.monotonic() > deadline:
                return card
            time.sleep(0.2)

    assert (served(1)["version"], served(1)["data_version"]) == (1, 1)

    # -- cycle 2, in-process: "killed" as its promotion starts, then run again
    watcher = Watcher(loop.source, loop.dataset)
    _drop(source, "b", 150, seed=4)
    watcher.look()
    ready = [f.url for f in watcher.look().ready]
    assert [Path(u).parent.name for u in ready] == ["b"]

    def kill_at(step: str):
        def tell(name: str, fields: dict) -> None:
            if name == step:
                raise KeyboardInterrupt(f"killed as {step} starts")

        return tell

    with pytest.raises(KeyboardInterrupt):
        api.loop_cycle(loop, ready, on_step=kill_at("promote"))
    store = Registry(loop.registry)
    assert store.versions("tiny") == [1]
    run2 = next(str(p) for p in (tmp_path / "runs").iterdir() if p.name.startswith(Path(run1).name + "+v2-"))
    ledger = read_events(run2)
    second = api.loop_cycle(loop, [f.url for f in watcher.look().ready])  # nothing new: v2 goes on
    assert (second.outcome, second.version, second.record["run"]) == ("promoted", 2, run2)
    assert second.record["from"] == run1 and second.record["steps"] > 10
    assert read_events(run2) == ledger, "the continuation had finished: its result, no training"
    assert store.versions("tiny") == [1, 2] and store.alias("tiny")["version"] == 2
    assert [e["event"] for e in store.events("tiny")] == ["model.promoted", "model.promoted"]
    card = served(2)  # the served model moved: a new file became the model that answers
    assert (card["version"], card["data_version"]) == (2, 2), card
    answer = requests.post(f"{serving.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200  # staleness: v2's commit to this first answer by a model trained on it
    committed = calendar.timegm(time.strptime(second.record["committed"], "%Y-%m-%dT%H:%M:%SZ"))
    assert 0 < served(2)["staleness_s"] <= time.time() - committed + 1

    # -- cycle 3: the gate refuses; the champion stays, and the version is not trained again
    _drop(source, "c", 150, seed=5)
    strict = spec.load(loop_file, ["set=[" + ",".join([*SETTINGS, "promote.min_improvement=0.9"]) + "]"])
    watcher.look()
    third = api.loop_cycle(strict, [f.url for f in watcher.look().ready])
    assert third.outcome == "rejected" and "needs 90.00% better" in third.record["reason"]
    assert third.record["model_version"] == 2 and store.alias("tiny")["version"] == 2
    assert served(2, timeout_s=0)["version"] == 2  # the refused version is not served
    assert api.loop_cycle(strict, []).outcome == "done"
    assert [(r["version"], r["outcome"]) for r in records.history(loop.state)] == [
        (1, "promoted"), (2, "promoted"), (3, "rejected")
    ]  # fmt: skip
    assert all(r["staleness_s"] > 0 for r in records.history(loop.state)[:2])
    chain = api.lineage(run2)
    assert [c["run"] for c in chain] == [run2, run1]

    # An ingested file rewritten since is not new data: reported and left alone.
    written = next((source / "a").iterdir())
    written.write_text(written.read_text() + '{"text": "late"}\n')
    assert written.as_uri().removeprefix("file://") in " ".join(watcher.look().changed)
