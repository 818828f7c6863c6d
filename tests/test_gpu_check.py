"""The GPU check (benchmarks/gpu.py) runs where it has to: one process on a machine without Ray.

The layers it measures import no Ray, and its CPU smoke (every part at tiny sizes) records, for each
part, figures or a named error, fails none, and says it is not a GPU figure. Each runs in a fresh
interpreter: benchmarks/gpu.py blocks `ray` in its process, which must not leak into this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"train", "plan", "checkpoint", "loader", "serve", "partition", "comm"}

# The Ray-free layers the check measures, then the rest of what benchmarks/gpu.py imports.
RAY_FREE = (
    "petatrain.train.recipe",
    "petatrain.models",
    "petatrain.plan.catalog",
    "petatrain.plan.estimate",
    "petatrain.plan.flops",
    "petatrain.plan.profile",
    "petatrain.plan.recommend",
    "petatrain.plan.pipeline",
    "petatrain.cost.formulas",
    "petatrain.cost.workload",
    "petatrain.cost.calibration",
    "petatrain.serve.engine",
    "petatrain.data.loading.stream",
    "petatrain.train.checkpoint",
    "petatrain.train.loop",
    "petatrain.train.steps",
    "petatrain.train.batches",
    "petatrain.train.parallel",
    "petatrain.train.pipeline.costs",
    "petatrain.data.index",
    "petatrain.data.ingest.stages",
)

# Imports each layer with `ray` blocked (an import of it raises ImportError) and prints the ones that failed.
IMPORT_EACH = """
import importlib, json, sys, traceback
sys.modules["ray"] = None
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed[name] = traceback.format_exc().strip().splitlines()[-1]
print(json.dumps(failed))
"""


def test_the_layers_the_gpu_check_runs_import_no_ray():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *RAY_FREE], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, f"these import Ray (the GPU machine has none): {failed}"


def test_the_gpu_check_refuses_to_pass_a_cpu_run_off_as_a_gpu_figure(tmp_path):
    if _has_cuda():
        pytest.skip("a CUDA device is here")
    done = _gpu_check("--out", str(tmp_path), timeout=120)
    assert done.returncode == 2 and "--smoke" in done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_gpu_check_smoke_runs_every_part_on_the_cpu(tmp_path):
    before = set((ROOT / "benchmarks" / "results").glob("gpu-*.json"))
    done = _gpu_check("--smoke", "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("gpu-*.json")
    record = json.loads(path.read_text())
    assert record["smoke"] is True and record["note"] == "cpu smoke, not a GPU figure"
    assert "cpu smoke, not a GPU figure" in done.stdout
    assert record["machine"]["torch"] and "cuda" in record["machine"]
    assert record["ray_imported"] is False
    assert set(record["parts"]) == PARTS
    for name, part in record["parts"].items():
        assert part.get("figures") or part.get("error"), f"{name}: neither figures nor an error"
        assert part["status"] == "ok", f"{name} failed on the CPU: {part.get('error') or part['figures']}"
    train = record["parts"]["train"]["figures"]["rows"]
    assert all("tokens_per_s" in r["petatrain"] for r in train)
    assert {r["compile"] for r in train} == {None, "eager"}
    assert len(record["parts"]["plan"]["figures"]["rows"]) >= 6
    assert set((ROOT / "benchmarks" / "results").glob("gpu-*.json")) == before, "a smoke wrote into results/"


def _gpu_check(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
