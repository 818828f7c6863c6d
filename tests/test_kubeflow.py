"""The continuous-training loop as a Kubeflow Pipelines pipeline (issue 40, section 2b):
petatrain.kubeflow's pipeline compiled to the spec a KFP cluster runs, and run end to end on the kfp
SDK's local runner (each step a subprocess), from kfp's own environment (tests/kubeflow/kfp.sh).
Every step's first try is SIGKILLed mid-way (tests/kill_once.sh); KFP's retry ends as one
uninterrupted run would, and a run that finds nothing new trains nothing."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from helpers import ROOT, kill_first_tries, stopped_ray_processes
from test_loop import _drop, _loop_file, _one_version_one_run_one_model

KFP = ROOT / "tests" / "kubeflow" / "kfp.sh"
EXAMPLE = ROOT / "examples" / "kubeflow" / "continuous.py"


@pytest.fixture(scope="module")
def kfp_python() -> str:
    """The python of kfp's environment (installed once; the suite starts the install early)."""
    done = subprocess.run(["bash", str(KFP), "install"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_pipeline_compiles_to_a_spec_with_retries_no_cache_and_the_pending_condition(kfp_python, tmp_path):
    spec_file = tmp_path / "continuous.yaml"
    argv = [kfp_python, str(EXAMPLE), str(ROOT / "examples" / "loop.yaml"), "--compile", str(spec_file)]
    argv += ["--image", "registry.example.com/petatrain:0.1.0", "--retries", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = yaml.safe_load(spec_file.read_text())
    assert spec["pipelineInfo"]["name"] == "petatrain-continuous"
    assert spec["root"]["inputDefinitions"]["parameters"]["loop_file"]["parameterType"] == "STRING"
    executors = spec["deploymentSpec"]["executors"]
    assert len(executors) == 3 and {e["container"]["image"] for e in executors.values()} == {
        "registry.example.com/petatrain:0.1.0"
    }
    root_tasks = spec["root"]["dag"]["tasks"]
    (condition,) = [t for t in root_tasks.values() if "triggerPolicy" in t]
    assert condition["triggerPolicy"]["condition"].endswith("== 'pending'")
    inner = spec["components"][condition["componentRef"]["name"]]["dag"]["tasks"]
    tasks = {**{k: v for k, v in root_tasks.items() if k != "condition-1"}, **inner}
    assert len(tasks) == 3  # ingest at the root; train, then promote, under the condition
    steps = {t["inputs"]["parameters"]["step"]["runtimeValue"]["constant"]: t for t in tasks.values()}
    assert sorted(steps) == ["ingest", "promote", "train"]
    for task in tasks.values():
        assert task["retryPolicy"]["maxRetryCount"] == 3
        assert not task["cachingOptions"].get("enableCache"), "a cached step would never see new files"
    assert steps["promote"]["dependentTasks"] == [next(k for k, t in inner.items() if t is steps["train"])]


def test_on_a_cluster_the_steps_read_the_deployed_loop_and_the_train_step_creates_the_runs_rayjob(kfp_python, tmp_path):
    """--cluster NAMESPACE/CONFIGMAP (what `deploy k8s --loop --cron kfp` applied): every step reads
    the loop from that ConfigMap, and the train step is `train_rayjob`, which creates the RayJob the
    ConfigMap holds, named after the pipeline run (KFP's `{{$.pipeline_job_uuid}}`, the same for the
    step's retries), and waits for it. No Kubernetes API here: the spec is what is checked."""
    spec_file = tmp_path / "cluster.yaml"
    argv = [kfp_python, str(EXAMPLE), "--compile", str(spec_file), "--cluster", "ml/tiny-config"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = yaml.safe_load(spec_file.read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["loop_file"]["defaultValue"] == ""
    executors = spec["deploymentSpec"]["executors"]
    functions = sorted(
        e["container"]["args"][e["container"]["args"].index("--function_to_execute") + 1] for e in executors.values()
    )
    assert functions == ["loop_step", "loop_step", "train_rayjob"]
    (condition,) = [t for t in spec["root"]["dag"]["tasks"].values() if "triggerPolicy" in t]
    tasks = {**spec["root"]["dag"]["tasks"], **spec["components"][condition["componentRef"]["name"]]["dag"]["tasks"]}
    named = {t["taskInfo"]["name"]: t for t in tasks.values() if "retryPolicy" in t}
    assert sorted(named) == ["ingest", "promote", "train"]
    for task in named.values():
        assert task["inputs"]["parameters"]["cluster"]["runtimeValue"]["constant"] == "ml/tiny-config"
        assert task["retryPolicy"]["maxRetryCount"] == 2 and not task["cachingOptions"].get("enableCache")
    train = named["train"]["inputs"]["parameters"]
    assert train["run"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert named["train"]["componentRef"]["name"] == "comp-train-rayjob"
    for bad in (
        ["--cluster", "ml/tiny-config", str(ROOT / "examples" / "loop.yaml")],
        ["--local", "--cluster", "ml/c"],
    ):
        done = subprocess.run([kfp_python, str(EXAMPLE), *bad], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.splitlines()[-1].startswith("continuous.py: error:"), done.stderr


@pytest.mark.slow
@pytest.mark.chaos
def test_the_local_runner_keeps_a_model_current_and_a_killed_step_is_retried_to_one_result(
    kfp_python, ray_local, tmp_path
):
    loop_file = _loop_file(tmp_path)
    _drop(tmp_path / "incoming", "a", 300, seed=3)
    env = {**kill_first_tries(tmp_path, ray_local), "PATH": "/usr/bin:/bin"}

    def run_pipeline() -> str:
        argv = [kfp_python, str(EXAMPLE), str(loop_file), "--local", "--backoff", "1s", "--image", "python:3.11"]
        argv += ["--root", str(tmp_path / "kfp")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert json.loads(done.stdout.splitlines()[-1])["state"] == "SUCCEEDED"
        return done.stdout + done.stderr

    log = run_pipeline()
    assert not stopped_ray_processes(), "the killed training's worker, held by its hang, outlived its try"
    # Each step's first try was killed, its retry succeeded: three steps, killed once each.
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["ingest", "promote", "train"]
    failed = [line for line in log.splitlines() if "Error:" in line or "failed (" in line]
    assert log.count("finished with status \x1b[91mFAILURE") == 3, failed
    assert log.count("with status \x1b[92mSUCCESS") == 4, log[-4000:]
    _one_version_one_run_one_model(tmp_path)

    # The next recurring run finds nothing new: ingest says so and nothing trains.
    log = run_pipeline()
    assert "Executing task \x1b[96m'loop-step-2'" not in log and "Output: 'done'" in log
    _one_version_one_run_one_model(tmp_path)
