"""The CLI as a newcomer meets it: help on every verb, the demo end to end."""

import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("verb", ["ingest", "inspect", "demo", "config", "train", "chaos", "report", "plan", "profile"])
def test_every_verb_has_help(verb):
    result = run_cli(verb, "--help")
    assert result.returncode == 0 and "Usage" in result.stdout


def test_demo_ingests_streams_and_resumes_exactly_once(tmp_path):
    result = run_cli("demo", "--root", str(tmp_path), "--documents", "400", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["inspect"]["verified"] is True
    assert report["ingest"]["exact_duplicates"] > 0 and sum(report["ingest"]["rejected"].values()) > 0
    stream = report["stream"]
    assert stream["exactly_once"] and stream["ranks_before"] == 2 and stream["ranks_after"] == 3
    assert stream["consumed_before"] + stream["consumed_after"] == stream["samples_in_epoch"]
    train = report["train"]  # a GPT on 2 workers, rank 1 killed at step 17, recovered
    assert train["attempts"] == 2 and [f["cause"] for f in train["failures"]] == ["kill"]
    assert train["steps"] == 40 and 0 < train["goodput"] < 1 and len(train["samples"]) == 2
    assert (tmp_path / "runs" / "demo" / "report.html").exists()
    again = run_cli("demo", "--root", str(tmp_path), "--documents", "400", "--no-train", "--json")
    assert json.loads(again.stdout)["ingest"]["files_new"] == 0, "a second demo run ingests nothing new"


_NOISY = """
import atexit, os, subprocess, sys
from petatrain import cli
cli._claim_stdout(True)
print("a print")
os.write(1, b"a write to fd 1\\n")
subprocess.run([sys.executable, "-c", "print('a child process')"])
atexit.register(print, "a print at exit, after the object")
cli._print_json({"ok": True})
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
        (["train", "examples/tiny.yaml", "--set", "parallel.strategy=pipeline"], "train runs ddp or fsdp"),
        (["chaos", "examples/tiny.yaml", "--every", "10s"], "soak mode needs both --every and --for"),
        (["report", "/nonexistent-run"], "error:"),
    ],
)
def test_training_verbs_fail_with_one_line(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-1000:]
