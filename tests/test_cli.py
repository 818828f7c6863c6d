"""The CLI as a newcomer meets it: help on every verb, one-line errors, --json, the demo end to end.

What starts no Ray runs in-process, through typer's CliRunner (`invoke`): help, bad flags, config
errors, `config`, `plan`, a missing dataset or run. A few calls run `python -m petatrain` in a
subprocess for what only a process shows: its exit code and one-line stderr after Ray was loaded,
and --json's stdout holding exactly one object whatever else writes to file descriptor 1."""

import dataclasses
import json
import re

import pytest
import typer
import yaml
from typer.testing import CliRunner

from conftest import run_cli
from petatrain.cli import app
from petatrain.config import IngestConfig

VERBS = [
    "ingest", "inspect", "demo", "config", "train", "tune", "chaos", "report", "lineage", "evaluate", "promote",
    "rollback", "loop", "serve", "plan", "profile", "dataset", "dataset events", "dataset gc", "mlflow", "mlflow sync",
    "keys", "keys create", "keys public", "keys rotate", "keys tls", "access", "access policy", "deploy", "deploy k8s",
]  # fmt: skip


def invoke(*args: str):
    """`petatrain ARGS` in this process; stdout and stderr apart, PETATRAIN_DEBUG off."""
    return CliRunner().invoke(app, list(args), env={"PETATRAIN_DEBUG": None}, catch_exceptions=False)


def _commands(command, path=()):
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield " ".join((*path, name))
        yield from _commands(sub, (*path, name))


def test_the_verbs_are_all_there_in_their_order_and_the_entry_point_is_the_app():
    from importlib.metadata import entry_points

    assert list(_commands(typer.main.get_command(app))) == VERBS
    (script,) = entry_points(group="console_scripts", name="petatrain")
    assert script.load() is app


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb):
    result = invoke(*verb.split(), "--help")
    assert result.exit_code == 0 and "Usage" in result.stdout, result.output


def test_no_verb_prints_the_verbs():
    result = invoke()
    assert "Usage" in result.output and all(verb in result.output for verb in ("ingest", "train", "deploy"))


def test_ingest_has_a_flag_for_every_ingest_setting_with_its_default():
    params = {p.name: p for p in typer.main.get_command(app).commands["ingest"].params}
    for f in dataclasses.fields(IngestConfig):
        param = params[f.name]
        assert param.opts == ["--" + f.name.replace("_", "-")] and param.default is None, f.name
        shown = f.metadata.get("default_help", f.default)
        assert (f"(default: {shown})" in param.help) == (shown != ""), (f.name, param.help)
    assert params["format"].help == "auto|jsonl|parquet|csv|text|webdataset|tfrecord (default: auto)"
    assert params["dedup"].help == "none|exact|near (default: near)"


def test_ingest_flags_override_only_what_they_name_and_set_overrides_them(tmp_path, monkeypatch):
    """The YAML's ingest section holds unless a flag names the setting; --set wins over both.
    Checked on the config the command hands to api.ingest, with no Ray started."""
    from petatrain import api
    from petatrain import console as quiet

    handed = {}

    class Summary:
        def to_dict(self):
            return {"dataset": "ds"}

    def fake_ingest(sources, out, **kwargs):
        handed.update(kwargs, sources=sources, out=out)
        return Summary()

    monkeypatch.setattr(api, "ingest", fake_ingest)
    monkeypatch.setattr(quiet, "quiet_ray", lambda: None)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("ingest:\n  dedup: none\n  shard_size: 16KB\n  max_chars: 500\n")
    result = invoke(
        "ingest", "a", "b", "--out", "ds", "--config", str(cfg), "--dedup", "exact", "--min-chars", "5",
        "--max-chars", "600", "--fields", "", "--set", "ingest.max_chars=700", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"dataset": "ds"} and result.stderr == ""
    settings = handed["config"]
    assert (handed["sources"], handed["out"]) == (["a", "b"], "ds")
    assert settings.dedup == "exact" and settings.min_chars == 5 and settings.fields == "", "flags win over the YAML"
    assert settings.shard_size == "16KB", "no flag named shard_size: the YAML's holds"
    assert settings.max_chars == 700, "--set wins over the flag and the YAML"
    assert settings.near_threshold == IngestConfig().near_threshold


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["config", "examples/tiny.yaml", "--set", "nope.x=1"], "unknown config key 'nope'"),
        (["config", "--set", "ingest.dedup=bogus"], "ingest.dedup: 'bogus' is not one of none, exact, near"),
        (["ingest", "x", "--out", "y", "--dedup", "bogus"], "ingest.dedup: 'bogus' is not one of"),
        (["ingest", "x", "--out", "y", "--pack-length", "8"], "ingest.pack_length needs ingest.tokenizer"),
        (["chaos", "examples/tiny.yaml", "--every", "10s"], "soak mode needs both --every and --for"),
        (["report", "/nonexistent-run"], "run not found: /nonexistent-run"),
        (["inspect", "/nonexistent"], "no dataset at /nonexistent"),
        (["plan", "examples/tiny.yaml", "--count", "-1"], "must be >= 0 and --max-count >= 1"),
        (["profile", "--steps", "0"], "--steps must be >= 1"),
        (["deploy", "k8s"], "deploy k8s needs a CONFIG and --out DIR"),
        (["deploy", "k8s", "examples/tiny.yaml", "--out", "unused", "--kind", "pod"], "--kind 'pod'"),
        (["loop", "no-loop.yaml", "--inject", "hang@steps=9"], "cannot read 'steps=9'"),
        (["config", "--set", "observe.profile_steps=0"], "observe.profile_at must be >= 0 (0: off) and"),
    ],
)
def test_a_users_error_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "examples/tiny.yaml", "--bogus"], "No such option: --bogus"),
        (["ingest", "x"], "Missing option '--out'"),
        (["plan", "--count", "many"], "Invalid value for '--count'"),
        (["ingest", "x", "--out", "y", "--near-threshold", "high"], "Invalid value for '--near-threshold'"),
    ],
)
def test_a_bad_flag_is_a_usage_error_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and "Usage" in result.stderr and message in result.stderr, result.output


def test_config_prints_the_resolved_config_as_yaml_or_one_json_object():
    as_json = invoke("config", "examples/tiny.yaml", "--set", "train.steps=7", "--json")
    assert as_json.exit_code == 0 and as_json.stderr == "", as_json.output
    resolved = json.loads(as_json.stdout)
    assert resolved["train"]["steps"] == 7
    as_yaml = invoke("config", "examples/tiny.yaml", "--set", "train.steps=7")
    assert as_yaml.exit_code == 0 and yaml.safe_load(as_yaml.stdout) == resolved


def test_plan_json_recommends_a_candidate():
    result = invoke("plan", "examples/tiny.yaml", "--accelerator", "H100-SXM", "--max-count", "8", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recommended"]["accelerator"] == "H100-SXM"


def test_json_from_the_command_line_is_one_object_on_stdout_and_nothing_on_stderr():
    result = run_cli("config", "examples/tiny.yaml", "--json")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-1000:]
    assert json.loads(result.stdout)["model"]["kind"] == "gpt"


@pytest.mark.slow  # end to end: a CLI process starting its own Ray
def test_demo_ingests_streams_and_resumes_exactly_once(tmp_path):
    """`petatrain demo` as a newcomer runs it: the console shows the training's progress, its kill
    in one line, no Ray log line, and the recovery; then the same demo with --json and no training
    ingests nothing new and reports the dataset and the loader's resume as one object."""
    result = run_cli("demo", "--root", str(tmp_path), "--documents", "400")
    assert result.returncode == 0, result.stderr[-2000:]
    out, err = result.stdout, result.stderr
    assert _noise(out + err) == [], out + err
    assert "every sample exactly once" in out and "all shards match their checksums" in out, out
    # A GPT on 2 workers, rank 1 killed at step 17: one line for the fault, one for the recovery.
    faults = [line for line in err.splitlines() if line.startswith("fault") or "Rank 1" in line]
    assert len(faults) == 1 and "kill on rank 1 at step 17" in faults[0], err
    assert any(line.startswith("recovered") for line in err.splitlines()), err
    assert re.search(r"step +40/40 +loss \d", err), err
    run = tmp_path / "runs" / "demo"
    targets = re.escape(str(run / "prometheus" / "targets.json"))
    said = rf"^metrics: http://127\.0\.0\.1:\d+/metrics  \(Prometheus file_sd: {targets}\)$"
    assert re.search(said, err, re.M), err  # at the start, before the first step's line
    assert (run / "logs" / "ray-driver.log").exists(), "Ray's driver log is kept with the run"
    assert (run / "report.html").exists()
    train = json.loads((run / "report.json").read_text())
    assert train["attempts"] == 2 and [f["cause"] for f in train["faults"]] == ["kill"], train["faults"]
    assert train["steps"]["kept"] == 40 and 0 < train["goodput"] < 1
    assert len(re.findall(r"^sample '", out, re.M)) == 2, out

    again = run_cli("demo", "--root", str(tmp_path), "--documents", "400", "--no-train", "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads(again.stdout)
    assert report["ingest"]["files_new"] == 0, "a second demo run ingests nothing new"
    assert report["inspect"]["verified"] is True
    assert report["inspect"]["exact_duplicates"] > 0 and sum(report["inspect"]["rejected"].values()) > 0
    stream = report["stream"]
    assert stream["exactly_once"] and stream["ranks_before"] == 2 and stream["ranks_after"] == 3
    assert stream["consumed_before"] + stream["consumed_after"] == stream["samples_in_epoch"]


_NOISY = """
import atexit, os, subprocess, sys
from petatrain.cli.common import claim_stdout, print_json
claim_stdout(True)
print("a print")
os.write(1, b"a write to fd 1\\n")
subprocess.run([sys.executable, "-c", "print('a child process')"])
atexit.register(print, "a print at exit, after the object")
print_json({"ok": True})
"""


def test_json_stdout_holds_only_the_object_whatever_else_prints():
    """--json: prints, writes to fd 1 and child processes (Ray's log forwarding, also at exit)
    go to stderr; the soak benchmark once failed to parse a run's JSON because of them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NOISY], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ok": True}
    for noise in ("a print", "a write to fd 1", "a child process", "a print at exit"):
        assert noise in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "examples/tiny.yaml", "--inject", "boom@step=1"], "unknown fault 'boom'"),
        (["train", "examples/tiny.yaml", "--set", "data.dataset=/nonexistent"], "no dataset at /nonexistent"),
        (["train", "examples/tiny.yaml", "--set", "parallel.strategy=zero1"], "train runs ddp or fsdp or pipeline"),
        (["train", "examples/tiny.yaml", "--set", "observe.profile_at=100000"], "observe.profile_at 100000 is past"),
    ],
)
def test_training_verbs_fail_with_one_line(args, message):
    """In a process of its own: these fail once Ray's library is loaded and its logging moved off
    the console (the in-process tests leave this process's logging alone)."""
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-1000:]


# Ray's own log format ("2026-01-01 12:00:00,000\tINFO file.py:12 -- ..."), its forwarded
# worker output ("(RayTrainWorker pid=12)", "(raylet)") and Python tracebacks.
_RAY_NOISE = re.compile(r"\t(DEBUG|INFO|WARNING|ERROR) \S+\.py:\d+ --|\(\w+ pid=\d+\)|\(raylet\)|pid=\d+|Traceback")


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if _RAY_NOISE.search(line)]


def _row(text: str, name: str) -> int:
    found = re.search(rf"│ {name}\s*│ (\d+)", text)
    assert found, f"no '{name}' row in:\n{text}"
    return int(found.group(1))


@pytest.mark.slow  # end to end: a CLI process starting its own Ray
def test_ingest_shows_its_stages_not_rays_logs_and_flags_override_only_what_they_name(tmp_path):
    """The console has petatrain's stage lines and table, none of Ray's log lines; the YAML's
    ingest section holds unless a flag names the setting (before, every flag's default won)."""
    from petatrain.data import synth

    synth.generate(str(tmp_path / "corpus"), documents=300, files=2)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("ingest:\n  dedup: none\n  shard_size: 16KB\n")
    result = run_cli(
        "ingest", str(tmp_path / "corpus"), "--out", str(tmp_path / "ds"), "--config", str(cfg), "--dedup", "exact"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert _noise(result.stdout + result.stderr) == [], result.stdout + result.stderr
    assert "ingest: committed" in result.stderr
    assert _row(result.stdout, "exact duplicates") > 0, "--dedup exact overrides the YAML's none"
    assert _row(result.stdout, "near duplicates") == 0
    assert _row(result.stdout, "shards written") > 1, "shard_size comes from the YAML: no flag named it"


@pytest.mark.slow
def test_training_progress_is_a_line_per_ten_steps_one_per_fault_and_one_on_recovery():
    """Rendered from the ledger's events: every rank's step events, a failure whose detail is a
    long traceback, each rank's resume; the console gets four lines."""
    from petatrain.console import TrainProgress
    from petatrain.observe import events as ev

    lines: list[str] = []
    progress = TrainProgress(lines.append, total_steps=20)
    step = {"t": 1.0, "step_s": 0.1, "data_wait_s": 0.0, "tokens": 1024, "loss": 2.5}
    for n in range(1, 13):
        for _rank in (0, 1):
            progress(ev.Step(**step, attempt=0, step=n))
    progress(ev.FaultInjected(t=1.0, attempt=0, fault="kill", step=12, rank=1))
    traceback = "Traceback (most recent call last):\n" + "  File 'x.py', line 1\n" * 30 + "ActorDiedError"
    progress(ev.Failure(t=1.0, attempt=0, cause="kill", rank=None, detail=traceback))
    progress(ev.Restart(t=1.0, attempt=1, reason="kill"))
    for _rank in (0, 1):
        progress(ev.Resume(t=1.0, attempt=1, step=10, checkpoint="run/ckpt/step-10"))
    for n in range(11, 21):
        progress(ev.Step(**step, attempt=1, step=n))
    progress(ev.End(t=1.0, status="ok", step=20))
    assert len(lines) == 4, lines
    assert lines[0].startswith("step     10/20  loss 2.5000  10,240 tokens/s")
    assert "kill on rank 1 at step 12 (injected)" in lines[1] and "Traceback" not in lines[1]
    assert "recovered" in lines[2] and "resumes at step 10" in lines[2]
    assert lines[3].startswith("step     20/20")


def test_training_progress_names_the_metrics_endpoint_and_its_target_file_at_the_start():
    from petatrain.console import TrainProgress

    lines: list[str] = []
    from petatrain.observe import events as ev

    progress = TrainProgress(lines.append, total_steps=20, targets="/runs/r/prometheus/targets.json")
    progress(
        ev.RunStart(t=1.0, run_id="r", workers=[2, 2], steps=20, config={}, metrics="http://127.0.0.1:9464/metrics")
    )
    progress(ev.RunContinue(t=2.0, run_id="r", attempt=1, previous="ok", steps=20))  # the endpoint off: nothing
    assert lines == ["metrics: http://127.0.0.1:9464/metrics  (Prometheus file_sd: /runs/r/prometheus/targets.json)"]


def test_a_resize_is_one_line_and_the_resume_says_on_how_many_workers():
    from petatrain.console import TrainProgress

    lines: list[str] = []
    from petatrain.observe import events as ev

    progress = TrainProgress(lines.append, total_steps=100)
    progress(ev.AttemptStart(t=1.0, attempt=1, world_size=2))
    detail = "petatrain.train.rank.Resized: the cluster can host more workers: checkpoint of step 9 committed"
    progress(ev.Failure(t=2.0, attempt=1, cause="resize", rank=0, detail=detail))
    progress(ev.AttemptStart(t=3.0, attempt=2, world_size=4))
    progress(ev.Resume(t=4.0, attempt=2, step=9, checkpoint="run/ckpt/step-9"))
    assert lines == [
        "[cyan]resize[/cyan]: the cluster has room for more workers again (checkpoint of step 9 committed); restarting",
        "[green]recovered[/green]: attempt 3 resumes at step 9 on 4 workers from its latest checkpoint",
    ]


def test_the_ledger_follower_hands_on_each_new_event_once_and_skips_an_earlier_runs(tmp_path):
    import time

    from petatrain.observe.events import record
    from petatrain.observe.ledger import LedgerFollower

    ledger = tmp_path / "events.jsonl"

    def line(kind: str, **fields) -> str:
        return json.dumps(record(kind, fields)) + "\n"

    start = line("run_start", run_id="r", workers=[1, 1], steps=9, config={})
    ledger.write_text(line("end", status="ok", step=9))  # a finished run, resumed
    seen: list = []
    follower = LedgerFollower(str(tmp_path), None, seen.append)
    step = line("step", attempt=0, step=1, step_s=0.1, data_wait_s=0.0, loss=1.0)
    with ledger.open("a") as handle:
        handle.write(step)  # another driver's, before ours starts
        handle.write(start + step[:20])  # a line half written
        handle.flush()
        time.sleep(1.2)
        assert [e.kind for e in seen] == ["run_start"]
        handle.write(step[20:] + line("end", status="ok", step=9))
    follower.stop()
    assert [e.kind for e in seen] == ["run_start", "step", "end"]


def test_rays_records_are_kept_until_the_run_folder_exists_then_written_there(tmp_path):
    import logging

    from petatrain.console import RayLogs

    assert RayLogs().finish("unused.log") == "", "no records, no file"
    logs = RayLogs()
    logger = logging.getLogger("ray.petatrain-test")
    logger.addHandler(logs)
    logger.propagate = False
    try:
        logger.warning("before the run folder exists")
        path = logs.attach(str(tmp_path / "run" / "logs" / "ray-driver.log"))
        logger.warning("after")
        assert logs.finish("unused.log") == path
    finally:
        logger.removeHandler(logs)
        logs.close()
    lines = (tmp_path / "run" / "logs" / "ray-driver.log").read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["before the run folder exists", "after"]
