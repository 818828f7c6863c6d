"""petatrain's continuous-training loop as a Kubeflow Pipelines (kfp 2.x) pipeline: ingest the stable
new files of the loop's source as a dataset version, then, if a version's cycle is pending, continue
the champion onto it and promote it through the gate. Each step is a component that runs `petatrain
loop LOOP.yaml --once --only STEP --json`, the same code the embedded loop and the Airflow DAGs run;
every step is idempotent, so KFP's retry of a step killed mid-way goes on where it stopped and
nothing is trained twice.

kfp 2.17 pins protobuf < 7 and requests 2.33.0, which petatrain's environment does not resolve
with, so the pipeline is built in kfp's own environment: install petatrain there without its
dependencies (`pip install --no-deps petatrain`: this module needs only the standard library and
kfp) and point `PETATRAIN_BIN` at the `petatrain` of petatrain's own environment. The components
themselves import nothing of petatrain (KFP ships a component as its function's source), so on a
cluster they run in an image that has `petatrain` on its PATH (`image=`; keep petatrain in its own
virtual environment in that image: KFP's launcher installs kfp into the image's `python3`).

KFP has no data-driven trigger like Airflow's assets: schedule the pipeline as a recurring run
(every few minutes, as the embedded loop polls); a run that finds nothing new ends after the ingest
step. Every task's cache is off, since the same loop file gives new results as files land."""

# No `from __future__ import annotations`: KFP reads the component's annotations as types.
from typing import Any


def loop_step(loop_file: str, step: str) -> str:
    """`petatrain loop LOOP --once --only STEP --json`, whose JSON goes to the task's log; the output is
    the cycle's outcome after the step ("trained", "promoted", "rejected", "done", ...), and after
    ingest "pending" when a version's cycle is not over (train and promote run). KFP ships this
    function's source as the component: everything it needs is imported inside."""
    import json
    import os
    import subprocess

    # constants.BIN_ENV, spelt out: KFP ships this function's source alone
    argv = [os.environ.get("PETATRAIN_BIN", "petatrain"), "loop", loop_file, "--once", "--only", step, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:  # petatrain's one-line error; KFP retries the task
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"petatrain loop --only {step} failed ({done.returncode}): {lines[-1] if lines else ''}")
    print(done.stdout)
    result = json.loads(done.stdout)
    # A retried ingest whose killed try committed the version finds it "done" but not handled: pending.
    if step == "ingest" and int(result.get("version") or 0) > 0 and not (result.get("record") or {}).get("handled"):
        return "pending"
    return str(result["outcome"])


def continuous_pipeline(
    *,
    image: str = "petatrain:latest",
    retries: int = 2,
    backoff: str = "5s",
    name: str = "petatrain-continuous",
    env: dict[str, str] | None = None,
) -> Any:
    """The loop as one KFP pipeline with a `loop_file` parameter: `ingest`, then, if it says a version
    is pending, `train` and `promote`. Each task retries `retries` times after `backoff`,
    runs with `env` set (e.g. PETATRAIN_BIN) and is never taken from KFP's cache."""
    from kfp import dsl

    # install_kfp_package: KFP's launcher needs kfp beside the function; the image's python3 gets it.
    component = dsl.component(loop_step, base_image=image)

    def step(loop_file: str, which: str) -> Any:
        task = component(loop_file=loop_file, step=which)
        task.set_display_name(which)
        task.set_retry(num_retries=retries, backoff_duration=backoff)
        task.set_caching_options(False)
        for key, value in (env or {}).items():
            task.set_env_variable(key, value)
        return task

    @dsl.pipeline(name=name, description="petatrain: new files -> a dataset version -> continued -> promoted")
    def continuous(loop_file: str) -> None:
        ingest = step(loop_file, "ingest")
        with dsl.If(ingest.output == "pending", name="a-version-is-pending"):
            train = step(loop_file, "train")
            step(loop_file, "promote").after(train)

    return continuous


def compile_pipeline(path: str, **kwargs: Any) -> str:
    """Write the pipeline's spec (IR YAML, what a KFP cluster runs) to `path`."""
    from kfp import compiler

    compiler.Compiler().compile(continuous_pipeline(**kwargs), package_path=path)
    return path
