"""The benchmarks that call petatrain's internals still run against them.

`benchmarks/checkpoint.py` times the training loop's own snapshot and writer calls (not a
copy of them), so a change to those calls must not leave the benchmark broken until its
next run. The 10M row with one timed checkpoint takes a few seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_checkpoint_benchmark_times_the_loops_own_snapshot(tmp_path):
    out = tmp_path / "row.json"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    command = [sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), "--row", "petatrain", "--size", "10M"]
    command += ["--folder", str(folder), "--out", str(out), "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads(out.read_text())
    assert len(row["samples"]) == 1 and len(row["live"]) == 1 and 0 < row["stall_s"] < row["background_s"]
    assert row["bytes"] > 10_000_000 * 12  # weights + AdamW state of ~10M parameters
