"""The MLflow mirror against a real MLflow server (its own environment, SQLite, 127.0.0.1)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from helpers import in_ci, read_events, tiny

SERVER = Path(__file__).resolve().parent / "mlflowserver" / "mlflow.sh"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """Started in the background (~6 s, most of it the server's imports) while a test trains with
    MLflow down; calling the fixture's value waits for the server and gives its URI."""
    from concurrent.futures import ThreadPoolExecutor

    folder = tmp_path_factory.mktemp("mlflow")
    command = ["bash", str(SERVER), "start", str(_free_port()), str(folder)]
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(subprocess.run, command, capture_output=True, text=True, timeout=900)

        def uri() -> str:
            started = starting.result()
            if started.returncode:
                message = f"the MLflow server did not start: {started.stderr[-2000:]}"
                pytest.fail(message) if in_ci() else pytest.skip(message)
            return started.stdout.strip()

        try:
            yield uri
        finally:
            starting.result()  # a start still under way is waited for, then stopped
            subprocess.run(["bash", str(SERVER), "stop", str(folder)], timeout=60)


def test_a_run_mlflow_missed_is_synced_later_once_and_a_promotion_is_a_model_version(
    mlflow_server, token_dataset, tmp_path, ray_local
):
    """Trained while MLflow is unreachable: the run ends ok and its ledger says what was not logged.
    `mlflow sync` then logs it (config as params, loss and eval by step, goodput, the report as
    artifacts); a second sync logs nothing twice. A promotion is a registered model version with its
    lineage as tags and the champion alias, and a rollback moves the alias back."""
    from mlflow.tracking import MlflowClient

    from petatrain import api

    run = tmp_path / "run"
    down = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    alone = ("parallel.workers=1", "train.steps=10", f"observe.mlflow_uri={down}")
    result = api.train(tiny(token_dataset, *alone), run_dir=str(run))
    assert result.steps == 10
    pending = [e for e in read_events(str(run)) if e["event"] == "mlflow"]
    assert [(e["status"], e["uri"]) for e in pending] == [("pending", down)] and pending[0]["detail"]

    server = mlflow_server()  # started while the run trained
    cfg = tiny(token_dataset, f"observe.mlflow_uri={server}")
    first = api.mlflow_sync(str(run), config=cfg, registry=str(tmp_path / "registry"))
    client = MlflowClient(tracking_uri=server)
    logged = client.get_run(first["mlflow_run_id"])
    assert logged.data.params["train.steps"] == "10" and logged.data.params["model.d_model"] == "64"
    assert logged.info.status == "FINISHED" and logged.data.tags["petatrain.run"] == str(run)
    losses = client.get_metric_history(first["mlflow_run_id"], "loss")
    assert sorted(m.step for m in losses) == list(range(1, 11))
    assert client.get_metric_history(first["mlflow_run_id"], "eval_loss") and "goodput" in logged.data.metrics
    assert {"report.html", "loss.png", "config.yaml"} <= {a.path for a in client.list_artifacts(first["mlflow_run_id"])}
    again = api.mlflow_sync(str(run), config=cfg, registry=str(tmp_path / "registry"))
    assert again["mlflow_run_id"] == first["mlflow_run_id"] and again["metrics"] == 0
    assert len(client.get_metric_history(first["mlflow_run_id"], "loss")) == 10

    reg = str(tmp_path / "registry")
    one = api.promote(str(run), "tiny", config=cfg, registry=reg)
    two = api.promote(str(run), "tiny", config=cfg, registry=reg, checkpoint="10", force=True)
    assert (one["mlflow"]["version"], two["mlflow"]["version"]) == ("1", "2")
    model = client.get_model_version_by_alias("tiny", "champion")
    assert model.version == "2" and model.tags["petatrain.version"] == "2" and model.run_id == first["mlflow_run_id"]
    assert '"how": "start"' in model.tags["petatrain.lineage"]
    api.rollback("tiny", config=cfg, registry=reg)
    assert client.get_model_version_by_alias("tiny", "champion").version == "1"
