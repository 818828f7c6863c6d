"""The MLflow mirror: a run's ledger logged as an MLflow run, a promotion as a registered model version.

The record stays petatrain's (the run's ledger, the registry on the object store); MLflow mirrors it
for the users who browse runs and models there. The client is `mlflow-skinny` (the `mlflow` extra):
it installs beside petatrain's pins, where the full `mlflow` package does not.

Idempotent: an MLflow run carries the tag `petatrain.run_id`, and the count of ledger events already
logged (`petatrain.synced_events`); syncing again logs only what came since. A model version carries
`petatrain.version`; a promotion mirrored twice finds it. MLflow down or unreachable: the caller
records it (the ledger's `mlflow` event, status pending) and goes on; `petatrain mlflow sync RUN`
logs it later.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from petatrain.errors import ConfigError, PetatrainError
from petatrain.observe import events as ev
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import exists, read_bytes

TAG_RUN = "petatrain.run_id"
TAG_URL = "petatrain.run"
TAG_SYNCED = "petatrain.synced_events"
TAG_VERSION = "petatrain.version"
_MAX_PARAM = 6000  # MLflow's limit on a parameter's value
_ARTIFACTS = ("report.html", "report.json", "loss.png", "timeline.png", "config.yaml")


def client(uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError(
            "observe.mlflow_uri is set but the MLflow client is not installed: pip install 'petatrain[mlflow]' "
            "(mlflow-skinny)"
        ) from None
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a server that is down: fail in seconds
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list | bool) else str(value)
    return out


def sync_run(run_url: str, uri: str, experiment: str = "petatrain", options: StorageOptions | None = None) -> dict:
    """Log the run's ledger (and what came since the last sync) as an MLflow run; what was logged."""
    from mlflow.entities import Metric, Param, RunStatus

    from petatrain.observe.ledger import load_events, prior_run_from

    events = load_events(run_url, options)
    prior = prior_run_from(events)
    if prior is None:
        raise PetatrainError(f"{run_url}: the run never started; nothing to log to MLflow")
    mlflow = client(uri)
    found = mlflow.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else mlflow.create_experiment(experiment)
    runs = mlflow.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN}` = '{prior.run_id}'", max_results=1)
    if runs:
        run = runs[0]
        done = int(run.data.tags.get(TAG_SYNCED, "0") or 0)
    else:
        name = run_url.rstrip("/").rsplit("/", 1)[-1]
        run = mlflow.create_run(experiment_id, run_name=name, tags={TAG_RUN: prior.run_id, TAG_URL: run_url})
        done = 0
    run_id = run.info.run_id
    logged = set(run.data.params) if runs else set()
    params = [Param(k, v[:_MAX_PARAM]) for k, v in _flat(prior.config).items() if k not in logged]
    metrics = []
    for e in events[done:]:
        ms = int(e.t * 1000)
        if isinstance(e, ev.Step) and e.loss is not None:
            metrics.append(Metric("loss", e.loss, ms, e.step))
            if e.lr is not None:
                metrics.append(Metric("lr", e.lr, ms, e.step))
            if e.tokens and e.step_s:
                metrics.append(Metric("tokens_per_s", e.tokens / e.step_s, ms, e.step))
        elif isinstance(e, ev.Eval):
            metrics.append(Metric("eval_loss", e.loss, ms, e.step))
    report = join(run_url, "report.json")
    fresh = any(not isinstance(e, ev.Mlflow) for e in events[done:])  # a sync's own record is not news
    if fresh and exists(report, options):
        goodput = json.loads(read_bytes(report, options)).get("goodput")
        if isinstance(goodput, int | float):
            metrics.append(Metric("goodput", float(goodput), int(events[-1].t * 1000), prior.step))
    for i in range(0, max(len(params), len(metrics)), 500):
        mlflow.log_batch(run_id, metrics=metrics[i : i + 500], params=params[i : i + 100] if i == 0 else [])
    if len(params) > 100:
        for i in range(100, len(params), 100):
            mlflow.log_batch(run_id, params=params[i : i + 100])
    with tempfile.TemporaryDirectory() as scratch:
        copied = []
        for name in _ARTIFACTS:
            if exists(join(run_url, name), options):
                with open(os.path.join(scratch, name), "wb") as out:
                    out.write(read_bytes(join(run_url, name), options))
                copied.append(name)
        if copied:
            mlflow.log_artifacts(run_id, scratch)
    mlflow.set_tag(run_id, TAG_SYNCED, str(len(events)))
    status = {"ok": RunStatus.FINISHED, "failed": RunStatus.FAILED, "stopped": RunStatus.KILLED}.get(prior.ended)
    if status is not None:
        mlflow.set_terminated(run_id, RunStatus.to_string(status))
    return {"mlflow_run_id": run_id, "experiment": experiment, "params": len(params), "metrics": len(metrics)}


def mlflow_run_id(run_url: str, uri: str, experiment: str, options: StorageOptions | None = None) -> str | None:
    """The MLflow run a petatrain run was mirrored as, or None."""
    from petatrain.observe.ledger import load_events, prior_run_from

    prior = prior_run_from(load_events(run_url, options))
    mlflow = client(uri)
    found = mlflow.get_experiment_by_name(experiment)
    if prior is None or found is None:
        return None
    runs = mlflow.search_runs([found.experiment_id], filter_string=f"tags.`{TAG_RUN}` = '{prior.run_id}'")
    return runs[0].info.run_id if runs else None


def mirror_version(record: dict[str, Any], uri: str, run_id: str, alias: str | None = "champion") -> str:
    """A registry version as an MLflow model version (tags: its version, checksum, dataset, lineage),
    its alias moved there; the MLflow version. Mirroring it again finds the one made before. Its
    source is the registry record, logged as an artifact of the run (`registry/NAME-vN/record.json`):
    MLflow takes no source outside a run's artifacts, and the weights stay where the record says."""
    from mlflow.exceptions import MlflowException

    mlflow = client(uri)
    name, version = str(record["name"]), str(record["version"])
    try:
        mlflow.create_registered_model(name, description="petatrain registry model (the record is on the object store)")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    made = [v for v in mlflow.search_model_versions(f"name='{name}'") if v.tags.get(TAG_VERSION) == version]
    if made:
        mirrored = made[0].version
    else:
        lineage = [
            {k: link.get(k) for k in ("run", "how", "start_step", "step", "reads")}
            for link in record.get("lineage") or []
        ]
        tags = {
            TAG_VERSION: version, "petatrain.checksum": str(record.get("checksum")),
            "petatrain.dataset": str(record.get("dataset")), "petatrain.lineage": json.dumps(lineage)[:5000],
            "petatrain.checkpoint": str(record.get("checkpoint")),
        }  # fmt: skip
        folder = f"registry/{name}-v{version}"
        with tempfile.TemporaryDirectory() as scratch:
            with open(os.path.join(scratch, "record.json"), "w") as out:
                json.dump(record, out, indent=2, sort_keys=True)
            mlflow.log_artifacts(run_id, scratch, artifact_path=folder)
        source = f"runs:/{run_id}/{folder}"
        mirrored = mlflow.create_model_version(name, source=source, run_id=run_id, tags=tags).version
    if alias:
        mlflow.set_registered_model_alias(name, alias, mirrored)
    return str(mirrored)


def move_alias(name: str, alias: str, version: int, uri: str) -> None:
    """After a rollback: the MLflow alias to the mirror of registry version `version`, if it was mirrored."""
    mlflow = client(uri)
    made = [v for v in mlflow.search_model_versions(f"name='{name}'") if v.tags.get(TAG_VERSION) == str(version)]
    if made:
        mlflow.set_registered_model_alias(name, alias, made[0].version)
