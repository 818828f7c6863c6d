"""The continuous-training loop on a real Airflow 3 (issue 40, section 2): petatrain.airflow's two
DAGs, run by Airflow's own scheduler on 127.0.0.1 (tests/airflow/airflow.sh: its own environment,
SQLite, LocalExecutor). New files become a dataset version announced as an asset event; the
training DAG, scheduled on that asset, continues and promotes. Every task's first try is SIGKILLed
mid-way (tests/kill_once.sh) and Airflow's retry ends as one uninterrupted run would."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import requests

from helpers import ROOT, kill_first_tries, stopped_ray_processes
from ray_head import free_ports
from test_loop import _drop, _loop_file, _one_version_one_run_one_model

AIRFLOW = ROOT / "tests" / "airflow" / "airflow.sh"


@pytest.fixture
def airflow(ray_local, tmp_path):
    port = free_ports(1)[0]
    home = tmp_path / "airflow"
    (home / "dags").mkdir(parents=True)
    # What the tasks run: petatrain's CLI from its own environment, through the shim that kills the
    # first try of each step (Airflow's processes, and so its tasks, inherit this environment).
    env = {**os.environ, **kill_first_tries(tmp_path, ray_local)}
    command = ["bash", str(AIRFLOW), "start", str(port), str(home)]
    started = subprocess.run(command, capture_output=True, text=True, env=env)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield started.stdout.strip(), home
    finally:
        subprocess.run(["bash", str(AIRFLOW), "stop", str(home)], capture_output=True, timeout=60)


def _api(url: str, home: Path):
    """A requests session holding the simple auth manager's admin token."""
    passwords = json.loads(next(home.glob("simple_auth_manager_passwords.json*")).read_text())
    user, password = next(iter(passwords.items()))
    token = requests.post(f"{url}/auth/token", json={"username": user, "password": password}, timeout=30)
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token.json()['access_token']}"
    return session


def _wait(what: str, check, timeout_s: float, home: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1.0)
    logs = "".join((home / "run" / f).read_text()[-1500:] for f in ("scheduler.log", "dag-processor.log"))
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


@pytest.mark.slow
@pytest.mark.chaos
def test_airflow_runs_the_loop_and_a_killed_task_is_retried_to_the_same_result(airflow, tmp_path):
    url, home = airflow
    loop_file = _loop_file(tmp_path)
    (home / "dags" / "loop_dags.py").write_text(
        "# An Airflow DAG file: petatrain's loop as two DAGs\n"
        "import datetime\n"
        "from petatrain.airflow import continuous_dags\n"
        f"continuous_dags({str(loop_file)!r}, schedule=None, retry_delay=datetime.timedelta(seconds=1))\n"
    )
    _drop(tmp_path / "incoming", "a", 300, seed=3)
    api = _api(url, home)
    for dag in ("petatrain_ingest", "petatrain_train"):
        _wait(f"{dag} parsed", lambda d=dag: api.get(f"{url}/api/v2/dags/{d}", timeout=30).ok, 120, home)
        assert api.patch(f"{url}/api/v2/dags/{dag}", json={"is_paused": False}, timeout=30).ok
    triggered = api.post(f"{url}/api/v2/dags/petatrain_ingest/dagRuns", json={"logical_date": None}, timeout=30)
    assert triggered.ok, triggered.text

    def finished(dag: str):
        runs = api.get(f"{url}/api/v2/dags/{dag}/dagRuns", timeout=30).json()["dag_runs"]
        return [r for r in runs if r["state"] in ("success", "failed")]

    (ingested,) = _wait("the ingest run", lambda: finished("petatrain_ingest"), 300, home)
    assert ingested["state"] == "success"
    (trained,) = _wait("the training run on the asset", lambda: finished("petatrain_train"), 420, home)
    assert trained["state"] == "success" and trained["run_type"] == "asset_triggered"

    # Each task's first try was killed, its second succeeded: three steps, killed once each.
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["ingest", "promote", "train"]
    tries = {}
    for dag, run in (("petatrain_ingest", ingested), ("petatrain_train", trained)):
        listed = api.get(f"{url}/api/v2/dags/{dag}/dagRuns/{run['dag_run_id']}/taskInstances", timeout=30).json()
        tries |= {t["task_id"]: (t["state"], t["try_number"]) for t in listed["task_instances"]}
    assert tries == {"ingest": ("success", 2), "train": ("success", 2), "promote": ("success", 2)}
    # The asset event carries the version and its counts.
    events = api.get(f"{url}/api/v2/assets/events", timeout=30).json()["asset_events"]
    assert [e["extra"]["version"] for e in events] == [1] and events[0]["extra"]["rows_added"] > 0

    _one_version_one_run_one_model(tmp_path)
    assert not stopped_ray_processes(), "the killed training's worker, held by its hang, outlived its try"
