"""`petatrain tune`: spaces checked before anything starts, an ASHA search that stops the bad
trials, a fault inside a trial that Tune never sees, and PBT's exploit continuing the donor's
whole state bit for bit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, tiny
from petatrain import api, config
from petatrain.errors import ConfigError
from petatrain.tune import space
from petatrain.tune.search import SearchJob, check, concurrency

LR = "train.lr=loguniform:3e-4:3e-2"


def _search(dataset: str, *overrides: str) -> config.JobConfig:
    return tiny(dataset, "parallel.workers=1", "train.eval_every=10", "tune.max_steps=30", *overrides)


def _events(run: str) -> list[dict]:
    with open(f"{run}/events.jsonl") as handle:
        return [json.loads(line) for line in handle]


# -- before anything starts ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("train.lr", "write KEY=SPACE"),
        ("train.lr=normal:0:1", "unknown space 'normal'"),
        ("train.lr=uniform:1", "uniform:LOW:HIGH"),
        ("train.lr=uniform:2:1", "LOW must be below HIGH"),
        ("train.lr=loguniform:0:1", "needs LOW > 0"),
        ("train.warmup_steps=randint:0:2.5", "integers"),
        ("model.d_model=choice:", "give the choices"),
        ("model.d_model=choice:64,64", "repeated"),
    ],
)
def test_a_bad_space_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        space.parse(spec)


def test_spaces_are_checked_against_the_config(tmp_path):
    cfg = tiny(str(tmp_path))
    with pytest.raises(ConfigError, match=r"no such config field \(did you mean train.lr\?\)"):
        space.check(cfg, [space.parse("train.lrr=uniform:0:1")])
    with pytest.raises(ConfigError, match="no such config field"):
        space.check(cfg, [space.parse("train=uniform:0:1")])  # a section, not a value
    # The config must build at both ends: tiny.yaml's min_lr is 3e-4.
    with pytest.raises(ConfigError, match=r"train.lr=loguniform:0.0001:0.01: at 0.0001: train.min_lr"):
        space.check(cfg, [space.parse("train.lr=loguniform:1e-4:1e-2")])
    # A share of train.lr follows it: the same search builds at both ends, and the floor is 10% of each.
    relative = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, min_lr="10%"))
    space.check(relative, [space.parse("train.lr=loguniform:1e-4:1e-2")])
    assert space.apply(relative, {"train.lr": 1e-4}).train.final_lr == pytest.approx(1e-5)
    with pytest.raises(ConfigError, match=r"model.n_layer=choice:2,x: at 'x'.*expected a number"):
        space.check(cfg, [space.parse("model.n_layer=choice:2,x")])
    with pytest.raises(ConfigError, match="nothing to search"):
        space.check(cfg, [])
    # Credentials are never searched: what a search samples goes into its trials' records.
    with pytest.raises(ConfigError, match=r"storage.s3_secret_access_key: the storage section .* is not searched"):
        space.check(cfg, [space.parse("storage.s3_secret_access_key=choice:a,b")])
    values = space.apply(cfg, {"model.d_model": 128, "train.lr": 0.01})
    assert (values.model.d_model, values.train.lr) == (128, 0.01)


def test_spaces_are_checked_together_an_integer_is_searched_with_integers_and_sizes_are_bounded(tmp_path):
    """Attack round 3 MED (issue 35): the corners were checked one space at a time against the base
    config, so d_model x n_head pairs that do not divide reached the trials; uniform over an integer
    field passed (its ends are whole) and every trial drew a fraction; a 20,000-value choice cost 35 s
    of checks and 10^9 trials were accepted."""
    from petatrain.tune import search

    cfg = tiny(str(tmp_path))  # d_model 64, n_head 2
    pair = [space.parse("model.d_model=choice:64,96"), space.parse("model.n_head=choice:2,64")]
    with pytest.raises(ConfigError, match=r"at model.d_model=96 with model.n_head=64: model.d_model \(96\) must be a"):
        space.check(cfg, pair)
    built = space.check(cfg, [space.parse("model.d_model=choice:64,128"), space.parse("model.n_head=choice:2,4")])
    assert sorted((c.model.d_model, c.model.n_head) for c in built) == [(64, 2), (64, 4), (128, 2), (128, 4)]
    with pytest.raises(
        ConfigError, match=r"model.d_model is an integer, and uniform draws fractions; .*randint:64:128"
    ):
        space.check(cfg, [space.parse("model.d_model=uniform:64:128")])
    with pytest.raises(ConfigError, match=r"20000 choices, over 1000"):
        space.parse("train.seed=choice:" + ",".join(map(str, range(20000))))
    with pytest.raises(ConfigError, match=r"tune.trials 1000000000 is over 10000"):
        tiny(str(tmp_path), "tune.trials=1000000000")
    # The largest trial a space makes sizes the gangs: parallel.workers up to 4 needs 4 CPUs whole.
    workers = space.check(cfg, [space.parse("parallel.workers=choice:1,4")])
    assert search.concurrency(cfg, 8, 0, workers) == 2
    with pytest.raises(ConfigError, match=r"a trial needs 4 CPU\(s\)"):
        search.concurrency(cfg, 3, 0, workers)


def test_search_settings_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"'val_loss' is never reported; a trial reports eval_loss, train_loss"):
        tiny(str(tmp_path), "tune.metric=val_loss")
    with pytest.raises(ConfigError, match=r"tune\.scheduler: 'hyperband' is not one of asha, pbt, none"):
        tiny(str(tmp_path), "tune.scheduler=hyperband")
    cfg = tiny(str(tmp_path), "train.eval_every=0", f"tune.params={{{LR.replace('=', ': ', 1)}}}")
    with pytest.raises(ConfigError, match=r"train\.eval_every is 0"):
        check(SearchJob(config=cfg, out=str(tmp_path / "out")))
    sealed = tiny(
        str(tmp_path), "train.eval_every=10", "tune.scheduler=pbt", "storage.encryption.key=file:/nonexistent",
        f"tune.params={{{LR.replace('=', ': ', 1)}}}",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="encrypted checkpoints are bound to the run"):
        check(SearchJob(config=sealed, out=str(tmp_path / "out")))
    # Concurrency: whole gangs only; a trial bigger than the cluster is refused.
    four = tiny(str(tmp_path), "parallel.workers=4", "tune.trials=6")
    assert concurrency(four, cpus=16, gpus=0) == 4
    assert concurrency(four, cpus=9, gpus=0) == 2
    assert concurrency(four, cpus=64, gpus=8) == 2  # on GPUs: 4 per trial
    with pytest.raises(ConfigError, match=r"a trial needs 4 CPU\(s\) and 0 GPU\(s\).*the cluster has 2 and 0"):
        concurrency(four, cpus=2, gpus=0)


def test_the_store_tune_pickles_its_state_with_holds_no_credential(ray_local):
    """Tune pickles the filesystem it keeps its state with into OUT/tune/tuner.pkl: on an object
    store that filesystem pickles without the keys, and resolves them again where it is used."""
    import ray.cloudpickle

    from petatrain.storage import StorageOptions
    from petatrain.tune import credentials

    options = StorageOptions(
        s3_endpoint_url="https://127.0.0.1:1", s3_access_key_id="AKIAPICKLE", s3_secret_access_key="pickleSecret42"
    )
    path, filesystem = credentials.tune_storage("s3://bucket/search", options)
    assert path == "bucket/search"
    data = ray.cloudpickle.dumps(filesystem)
    assert b"pickleSecret42" not in data and b"AKIAPICKLE" not in data
    trial_side = ray.cloudpickle.loads(data)  # a trial actor: the options come from Ray's object store
    assert (trial_side.handler.fs.key, trial_side.handler.fs.secret) == ("AKIAPICKLE", "pickleSecret42")


def test_the_cli_refuses_a_bad_search_in_one_line(tmp_path):
    from conftest import run_cli

    out = tmp_path / "search"
    done = run_cli("tune", "examples/tiny.yaml", "--out", str(out), "--param", "train.lrr=uniform:0.001:0.01")
    assert done.returncode == 2  # a config error
    assert done.stderr.strip().splitlines() == [
        "error: --param train.lrr: no such config field (did you mean train.lr?)"
    ], done.stderr
    assert not out.exists()  # nothing was written


# -- searches ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def asha(token_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("asha") / "search"
    cfg = _search(token_dataset, "tune.trials=4", "tune.scheduler=asha")
    lines: list[str] = []
    summary = api.tune(cfg, str(out), params=[LR], on_progress=lines.append)
    return out, summary, lines


@pytest.mark.slow
def test_asha_stops_the_bad_trials_and_best_yaml_is_the_best_trial(asha):
    out, summary, lines = asha
    trials = {t["trial"]: t for t in summary["trials"]}
    assert len(trials) == 4 and all(t["error"] is None for t in trials.values())
    stopped = [d for d in summary["decisions"] if d["decision"] == "stopped"]
    assert stopped, summary["decisions"]
    for d in stopped:  # ASHA stops a trial below its rung's cutoff: another trial did better there
        mine = dict(map(tuple, trials[d["trial"]]["curve"]))[d["step"]]
        others = [dict(map(tuple, t["curve"])).get(d["step"]) for k, t in trials.items() if k != d["trial"]]
        assert any(v is not None and v < mine for v in others), (d, trials)
        assert trials[d["trial"]]["status"] == "stopped" and d["step"] < 30
        end = _events(trials[d["trial"]]["run"])[-1]
        assert (end["event"], end["status"]) == ("end", "stopped")
    finished = [t for t in trials.values() if t["status"] == "finished"]
    assert finished and all(t["step"] == 30 for t in finished)
    best = min(trials.values(), key=lambda t: t["eval_loss"])
    assert summary["best"]["trial"] == best["trial"]
    written = config.load(out / "best.yaml")
    assert written.train.lr == best["params"]["train.lr"] and written.train.steps == 30
    assert "tune" not in yaml.safe_load((out / "best.yaml").read_text())  # a config train runs as is
    # Every trial is a run of its own, with its report; the page marks the decisions.
    for t in trials.values():
        assert (out / "trials" / t["trial"] / "report.json").exists()
    page = (out / "tune.html").read_text()
    assert all(t in page for t in trials) and "Scheduler decisions" in page and "stopped" in page
    assert any("stopped by the scheduler" in line for line in lines)


@pytest.mark.slow
def test_the_same_search_again_resumes_it_and_another_is_refused(asha, token_dataset):
    out, summary, _ = asha
    cfg = _search(token_dataset, "tune.trials=4", "tune.scheduler=asha")
    lines: list[str] = []
    again = api.tune(cfg, str(out), params=[LR], on_progress=lines.append)  # Tune's restore: nothing to rerun
    assert lines[0].startswith("resuming the search")
    assert {t["trial"]: t["eval_loss"] for t in again["trials"]} == {
        t["trial"]: t["eval_loss"] for t in summary["trials"]
    }
    with pytest.raises(ConfigError, match="holds another search"):
        api.tune(cfg, str(out), params=["train.lr=loguniform:1e-3:3e-2"])


@pytest.mark.slow
@pytest.mark.chaos
def test_a_worker_killed_inside_a_trial_is_recovered_there(asha, token_dataset, tmp_path):
    """The same first trial as the ASHA search (same seed, same sample), with a worker killed at step
    15: Tune sees no failure and the evaluations are the fault-free search's."""
    _, clean, _ = asha
    cfg = _search(token_dataset, "tune.trials=1", "tune.scheduler=none")
    faulty = api.tune(cfg, str(tmp_path / "faulty"), params=[LR], injections=["kill@step=15,rank=0"])
    curves = {json.dumps(t["params"]): t["curve"] for t in clean["trials"]}
    assert len(faulty["trials"]) == 1
    for t in faulty["trials"]:
        assert t["status"] == "finished" and t["error"] is None  # Tune saw no failure
        before = curves[json.dumps(t["params"])]  # ASHA may have stopped it: what it evaluated until then
        assert before and t["curve"][: len(before)] == before  # deterministic: the same evaluations
        causes = [e["cause"] for e in _events(t["run"]) if e["event"] == "failure"]
        assert causes == ["kill"]


@pytest.mark.slow
def test_pbt_continues_the_donors_whole_state_bit_for_bit(token_dataset, tmp_path):
    cfg = _search(token_dataset, "tune.trials=2", "tune.scheduler=pbt", "tune.pbt_synch=true", "tune.max_steps=20")
    summary = api.tune(cfg, str(tmp_path / "pbt"), params=[LR])
    assert any(d["decision"] == "exploit" for d in summary["decisions"]), summary["decisions"]

    def steps_of(events: list[dict], attempt: int) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in events if e["event"] == "step" and e["attempt"] == attempt}

    # An exploit at the last evaluation has no steps left to train: take one that has.
    events, branched = next(
        (events, e)
        for events in (_events(t["run"]) for t in summary["trials"])
        for e in events
        if e["event"] == "run_continue" and e.get("source") and steps_of(events, e["attempt"])
    )
    donor, step = branched["source"]["from"].removeprefix("trial "), branched["source"]["step"]
    mine = steps_of(events, branched["attempt"])
    assert min(mine) == step + 1
    # The donor's state as it reported it to Tune (its own run may have branched since): a
    # folder laid out as a run, which `train --from` takes as well.
    reported = [
        p.parent
        for p in (tmp_path / "pbt" / "tune").glob(f"*{donor}*/checkpoint_*/petatrain-trial.json")
        if json.loads(p.read_text())["step"] == step
    ]
    assert reported, f"no checkpoint of step {step} reported by trial {donor}"
    # What the donor computes from that state with the receiver's new hyperparameters.
    mutated = config.build(config.JobConfig, branched["config"])
    reference = api.train(mutated, run_dir=str(tmp_path / "reference"), branch=f"{reported[0]}@{step}")
    ref = {e["step"]: e["loss"] for e in _events(reference.run) if e["event"] == "step"}
    assert mutated.train.lr != config.build(config.JobConfig, events[0]["config"]).train.lr
    assert all(mine[s] == ref[s] for s in mine), (mine, ref)


@pytest.mark.slow
def test_train_from_another_run_continues_its_state_bit_for_bit(token_dataset, baseline, tmp_path):
    """`train --from RUN@STEP` with the same config retraces RUN from STEP exactly."""
    from helpers import sha256

    cfg = tiny(token_dataset)
    result = api.train(cfg, run_dir=str(tmp_path / "branch"), branch=f"{baseline}@20")
    start = next(e for e in _events(result.run) if e["event"] == "run_start")
    assert start["source"] == {"from": f"{baseline}@20", "step": 20}
    ours = {e["step"]: e["loss"] for e in _events(result.run) if e["event"] == "step"}
    theirs = {e["step"]: e["loss"] for e in _events(str(baseline)) if e["event"] == "step"}
    assert sorted(ours) == list(range(21, 31)) and all(ours[s] == theirs[s] for s in ours)
    assert sha256(tmp_path / "branch" / "final" / "model.safetensors") == sha256(
        baseline / "final" / "model.safetensors"
    )
    with pytest.raises(ConfigError, match=r"no committed checkpoint of step 7"):
        api.train(cfg, run_dir=str(tmp_path / "nope"), branch=f"{baseline}@7")


def test_examples_tune_yaml_loads():
    cfg = config.load(ROOT / "examples" / "tune.yaml")
    assert cfg.tune.params and cfg.tune.scheduler == "asha"


def _served(bucket: str) -> int:
    """Bytes the test S3 server sent for GETs of `bucket`'s objects (its usage log, `rgw.sh usage`)."""
    import subprocess

    from conftest import RGW, _rgw_state

    done = subprocess.run(["bash", str(RGW), "usage", _rgw_state()], capture_output=True, text=True, check=True)
    return sum(
        category["bytes_sent"]
        for entry in json.loads(done.stdout).get("entries", [])
        for b in entry.get("buckets", [])
        if b.get("bucket") == bucket
        for category in b.get("categories", [])
        if category.get("category") == "get_obj"
    )


@pytest.mark.slow
@pytest.mark.s3
def test_trials_on_a_node_fetch_each_shard_from_the_object_store_once(s3_endpoint, s3_bucket, ray_local, tmp_path):
    """Two trials (sampled by Optuna) read the S3 dataset through the node's shard cache: the server
    sends each shard once."""
    import os
    import time

    from petatrain.data import synth

    if os.environ.get("PETATRAIN_TEST_S3_ENDPOINT"):
        pytest.skip("counts requests in the usage log of the RGW the tests start")
    synth.generate(str(tmp_path / "corpus"), documents=600, files=2)
    ingest = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="100KB", dedup="exact")
    dataset = f"{s3_bucket}/ds"
    api.ingest([str(tmp_path / "corpus")], dataset, config=ingest)
    cache = tmp_path / "cache"
    cfg = _search(
        dataset, f"data.cache_dir={cache}", "tune.trials=2", "tune.scheduler=none", "tune.max_steps=10",
        "tune.search=optuna",  # Tune's OptunaSearch samples the trials here
    )  # fmt: skip
    bucket = s3_bucket.removeprefix("s3://")
    time.sleep(2.5)  # the usage log is flushed every second
    before = _served(bucket)
    summary = api.tune(cfg, str(tmp_path / "search"), params=[LR])
    assert [t["status"] for t in summary["trials"]] == ["finished", "finished"]
    time.sleep(2.5)
    sent = _served(bucket) - before
    cached = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert cached > 0
    # Each shard crossed the network once (plus the index and manifest each trial opens), not once per trial.
    assert cached <= sent < 1.3 * cached, (sent, cached)


@pytest.mark.slow
@pytest.mark.chaos
def test_a_killed_search_resumes_from_its_trials_ledgers_and_writes_no_credential(token_dataset, ray_local, tmp_path):
    """Attack round 3. (1) S3 keys from the environment or the config were pickled into
    OUT/tune/tuner.pkl, and Tune's runtime environment put the environment's into Ray's logs.
    (2) After the `tune` driver was SIGKILLed and the same command run again, trials that had
    finished were reported "stopped" at an earlier step with that step's loss (Tune's last saved
    state), and `best` was chosen from those. A search's result comes from its trials' ledgers."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from petatrain.observe.ledger import read_events

    env_secret, env_key, config_secret = "tuneEnvSecret7f3q", "AKIAENVKEY7F3Q", "tuneConfigSecret9q2w"
    out = tmp_path / "search"
    argv = [
        sys.executable, "-m", "petatrain", "tune", str(ROOT / "examples" / "tiny.yaml"), "--out", str(out),
        "--address", ray_local.get_runtime_context().gcs_address, "--param", LR, "--trials", "2",
        "--scheduler", "none", "--max-steps", "30", "--json", "--set", f"data.dataset={token_dataset}",
        "--set", "parallel.workers=1", "--set", "train.eval_every=10", "--set", "faults.hang_timeout_s=6",
        "--set", f"storage.s3_secret_access_key={config_secret}",
    ]  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": env_key, "AWS_SECRET_ACCESS_KEY": env_secret}

    def ledgers() -> dict[str, list[dict]]:
        found = {}
        for path in out.glob("trials/*/events.jsonl"):
            found[path.parent.name] = read_events(str(path.parent))
        return found

    first = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and first.poll() is None:
            if any(e["event"] == "end" and e["status"] == "ok" for events in ledgers().values() for e in events):
                break
            time.sleep(0.1)
        assert first.poll() is None, first.communicate()[1].decode()[-3000:]
        os.killpg(first.pid, signal.SIGKILL)  # as soon as a trial's run has ended: before Tune records it
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    ended_before = {t for t, events in ledgers().items() if events[-1]["event"] == "end"}
    assert ended_before

    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    runs = ledgers()
    assert len(summary["trials"]) == 2
    for t in summary["trials"]:
        events = runs[t["trial"]]
        last_eval = [e for e in events if e["event"] == "eval"][-1]
        assert (t["status"], t["step"], t["eval_loss"]) == ("finished", 30, last_eval["loss"]), t
        assert last_eval["step"] == 30
        if t["trial"] in ended_before:  # nothing trained again
            assert [e["event"] for e in events].count("run_start") == 1 and events[-1]["event"] == "end"
    best = min(summary["trials"], key=lambda t: t["eval_loss"])
    assert summary["best"]["trial"] == best["trial"] and summary["decisions"] == []

    # No credential in anything the search wrote, Tune's pickled state included, nor in Ray's logs.
    session = ray_local._private.worker._global_node.get_session_dir_path()
    written = [p for root in (out, Path(session) / "logs") for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "tuner.pkl" for p in written)
    for path in written:
        data = path.read_bytes()
        for secret in (env_secret, env_key, config_secret):
            assert secret.encode() not in data, (secret, path)


def test_a_search_whose_every_trial_failed_exits_1_with_one_line(monkeypatch, tmp_path):
    """A script or CI running `petatrain tune` must see a search that produced nothing: exit 1, one
    error line saying how many trials failed and where their errors are; --json still prints the summary."""
    from typer.testing import CliRunner

    from petatrain import api
    from petatrain.cli import app

    summary = {
        "out": str(tmp_path), "metric": "eval_loss", "mode": "min", "scheduler": "asha", "search": "random",
        "params": {"train.lr": "loguniform:0.0003:0.03"}, "wall_s": 1.0, "html": str(tmp_path / "tune.html"),
        "best": None, "trials": [
            {"trial": f"t{i}", "params": {"train.lr": 0.01}, "eval_loss": None, "step": None, "status": "failed",
             "goodput": None, "error": "ValueError: boom"} for i in range(2)
        ],
    }  # fmt: skip
    monkeypatch.setattr(api, "tune", lambda *a, **k: summary)
    done = CliRunner().invoke(app, ["tune", str(ROOT / "examples" / "tune.yaml"), "--out", str(tmp_path)])
    assert done.exit_code == 1
    assert "error: no trial reported eval_loss (2 of 2 failed): no best config" in done.output
    as_json = CliRunner().invoke(app, ["tune", str(ROOT / "examples" / "tune.yaml"), "--out", str(tmp_path), "--json"])
    assert as_json.exit_code == 1 and '"best": null' in as_json.output
