"""petatrain's continuous-training loop as Airflow 3 DAGs: an ingest DAG whose task announces each new
dataset version as an asset event, and a training DAG scheduled on that asset (continue, then
evaluate and promote).

Airflow runs in its own environment: Airflow 3.3.2 requires fastapi < 0.137 and petatrain pins
0.165.0 for Ray Serve, so the two cannot share one (docs/continuous-training.md). This module imports
only the standard library and Airflow's task SDK: install petatrain into Airflow's environment
without its dependencies (`pip install --no-deps petatrain`) and point `PETATRAIN_BIN` at the
`petatrain` of petatrain's own environment. Each task runs `petatrain loop LOOP.yaml --once --only
STEP --json` there, the same code the embedded loop runs; every step is idempotent, so an Airflow
retry after a kill goes on where the killed try stopped and nothing is trained twice.

Deferrable operators do not apply here: a task's time is spent training or ingesting in its own
process, not waiting on something elsewhere. On Kubernetes, submitting the cycle as a RayJob and
deferring while it runs would free the worker slot (`deploy k8s --loop` writes the RayCronJob
instead)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from typing import Any

from petatrain.constants import BIN_ENV  # the standard library only


def run_step(loop_file: str, step: str, *, timeout_s: float | None = None) -> dict[str, Any]:
    """`petatrain loop LOOP --once --only STEP --json` in petatrain's environment: its one JSON object;
    a failure raises with petatrain's one-line error (Airflow retries the task)."""
    argv = [os.environ.get(BIN_ENV, "petatrain"), "loop", loop_file, "--once", "--only", step, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"petatrain loop --only {step} failed ({done.returncode}): {lines[-1] if lines else ''}")
    return dict(json.loads(done.stdout))


def dataset_uri(loop_file: str) -> str:
    """The Asset URI of the loop's dataset: its URL, `file://` for a local path."""
    import yaml  # Airflow depends on PyYAML

    with open(loop_file) as handle:
        dataset = str((yaml.safe_load(handle) or {}).get("dataset") or "")
    if not dataset:
        raise ValueError(f"{loop_file}: no dataset")
    return dataset if "://" in dataset else "file://" + os.path.abspath(dataset)


def continuous_dags(
    loop_file: str,
    *,
    schedule: str | dt.timedelta = dt.timedelta(minutes=5),
    prefix: str = "petatrain",
    retries: int = 2,
    retry_delay: dt.timedelta = dt.timedelta(seconds=5),
) -> tuple[Any, Any]:
    """The loop `loop_file` as two DAGs: `PREFIX_ingest` (on `schedule`: the stable new files of the
    source appended as a version, announced as an event of the dataset's Asset with the version and
    its counts as extra; skipped, with no event, when nothing new came) and `PREFIX_train`, scheduled
    on that Asset: `train` (the champion continued onto the version) then `promote` (evaluated, and
    promoted if the gate passes)."""
    from airflow.exceptions import AirflowSkipException
    from airflow.sdk import Asset, dag, task

    dataset = Asset(dataset_uri(loop_file))
    args = {"retries": retries, "retry_delay": retry_delay}
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    # One run of each at a time: versions queue for the training DAG instead of racing for the loop.
    once = {"start_date": start, "catchup": False, "default_args": args, "max_active_runs": 1}

    @dag(dag_id=f"{prefix}_ingest", schedule=schedule, **once)
    def ingest_dag() -> None:
        @task(outlets=[dataset])
        def ingest(**context: Any) -> dict[str, Any]:
            done = run_step(loop_file, "ingest")
            event = done["record"]
            # A retry whose killed try committed the version announces it, unless its cycle is over.
            retried = context["ti"].try_number > 1 and done["outcome"] == "done" and not event.get("handled")
            if done["outcome"] != "committed" and not retried:  # nothing new: no event, training rests
                raise AirflowSkipException(f"no new version ({done['outcome']})")
            keys = ("version", "rows", "rows_added", "tokens_added", "duplicates_dropped", "rejected", "committed")
            context["outlet_events"][dataset].extra = {k: event.get(k) for k in keys}
            return done

        ingest()

    @dag(dag_id=f"{prefix}_train", schedule=[dataset], **once)
    def train_dag() -> None:
        @task
        def train() -> dict[str, Any]:
            return run_step(loop_file, "train")

        @task
        def promote(trained: dict[str, Any]) -> dict[str, Any]:
            return run_step(loop_file, "promote")

        promote(train())

    return ingest_dag(), train_dag()
