"""Shared fixtures: a local Ray for the session, a real S3-compatible server, corpora."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RGW = ROOT / "tests" / "s3server" / "rgw.sh"

# Ray workers inherit these; pyarrow's S3 client needs them against non-AWS endpoints.
os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_REQUIRED")
os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "WHEN_REQUIRED")


BARBICAN = ROOT / "tests" / "kms" / "barbican.sh"
MLFLOW = ROOT / "tests" / "mlflowserver" / "mlflow.sh"
AIRFLOW = ROOT / "tests" / "airflow" / "airflow.sh"
KFP = ROOT / "tests" / "kubeflow" / "kfp.sh"
_installs: list[subprocess.Popen] = []


def pytest_collection_modifyitems(session, config, items) -> None:
    """Barbican's Debian packages (~70 s on a fresh machine) install in the background from the
    start, while the suite mostly waits on Ray; test_kms.py's `barbican.sh start` waits for it."""
    if os.geteuid() == 0 and any(item.path.name == "test_kms.py" for item in items):
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "petatrain-barbican-install.log"), "w")  # noqa: SIM115
        _installs.append(subprocess.Popen(["bash", str(BARBICAN), "install"], stdout=log, stderr=log))
    if any(item.path.name == "test_mlflow.py" for item in items):  # the MLflow server's environment, likewise
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "petatrain-mlflow-install.log"), "w")  # noqa: SIM115
        _installs.append(subprocess.Popen(["bash", str(MLFLOW), "install"], stdout=log, stderr=log))
    if any(item.path.name == "test_airflow.py" for item in items):  # Airflow's environment, likewise
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "petatrain-airflow-install.log"), "w")  # noqa: SIM115
        _installs.append(subprocess.Popen(["bash", str(AIRFLOW), "install"], stdout=log, stderr=log))
    if any(item.path.name == "test_kubeflow.py" for item in items):  # the KFP SDK's environment, likewise
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "petatrain-kfp-install.log"), "w")  # noqa: SIM115
        _installs.append(subprocess.Popen(["bash", str(KFP), "install"], stdout=log, stderr=log))


def pytest_sessionfinish(session, exitstatus) -> None:
    for install in _installs:
        install.wait()


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray (2 CPUs) shared by the in-process tests, started as petatrain starts one
    (listening on 127.0.0.1 only)."""
    import ray

    from petatrain.runtime.cluster import init_ray, stop_ray

    init_ray("", local_cpus=2)
    yield ray
    stop_ray()


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 endpoint: PETATRAIN_TEST_S3_ENDPOINT if set, else a Ceph RGW started here.

    The server's credentials are exported as AWS_* variables before Ray starts (tests
    that use S3 request this fixture before ray_local), so Ray workers see them too.
    """
    external = os.environ.get("PETATRAIN_TEST_S3_ENDPOINT")
    if external:
        os.environ["AWS_ENDPOINT_URL"] = external
        yield external
        return
    state = _rgw_state()
    started = subprocess.run(["bash", str(RGW), "start", state], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"could not start the S3 test server:\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}")
    env = subprocess.run(["bash", str(RGW), "env", state], capture_output=True, text=True, check=True).stdout
    for line in env.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            os.environ[key] = value.strip().strip("'\"")
    try:
        yield os.environ["AWS_ENDPOINT_URL"]
    finally:
        subprocess.run(["bash", str(RGW), "stop", state], capture_output=True, text=True)


def _rgw_state() -> str:
    return os.environ.get("PETATRAIN_RGW_DIR", "/tmp/petatrain-rgw-test")


@pytest.fixture(scope="session")
def s3_identity(s3_endpoint):
    """NAME -> an S3 user besides the bucket owner (created on the test RGW by `rgw.sh user`):
    {"key", "secret", "principal"}. The owner grants it access with a bucket policy."""
    if os.environ.get("PETATRAIN_TEST_S3_ENDPOINT"):
        pytest.skip("S3 users are created on the RGW the tests start (PETATRAIN_TEST_S3_ENDPOINT is set)")
    made: dict[str, dict[str, str]] = {}

    def identity(name: str) -> dict[str, str]:
        if name not in made:
            out = subprocess.run(["bash", str(RGW), "user", name, _rgw_state()], capture_output=True, text=True)
            if out.returncode != 0:
                pytest.fail(f"rgw.sh user {name} failed:\n{out.stderr[-2000:]}")
            env = dict(line[len("export ") :].split("=", 1) for line in out.stdout.splitlines() if "=" in line)
            made[name] = {
                "key": env["AWS_ACCESS_KEY_ID"],
                "secret": env["AWS_SECRET_ACCESS_KEY"],
                "principal": env["PETATRAIN_TEST_S3_PRINCIPAL"],
            }
        return made[name]

    return identity


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket URL, s3://petatrain-test-XXXX."""
    from petatrain.storage import resolve

    name = f"petatrain-test-{uuid.uuid4().hex[:8]}"
    fs, _ = resolve(f"s3://{name}")
    fs.mkdir(name)
    yield f"s3://{name}"
    with contextlib.suppress(Exception):  # a failed test may leave it half-deleted; the server goes anyway
        fs.rm(name, recursive=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A planted-duplicate JSONL corpus shared by read-only tests."""
    from petatrain.data import synth

    out = tmp_path_factory.mktemp("corpus")
    return synth.generate(str(out), documents=1500, files=3, seed=7)


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the `petatrain` CLI in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "petatrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


@pytest.fixture(scope="session")
def token_dataset(tmp_path_factory, ray_local):
    from petatrain import config
    from petatrain.data import synth
    from petatrain.data.ingest import IngestJob, run

    root = tmp_path_factory.mktemp("tokens")
    synth.generate(str(root / "corpus"), documents=500, files=2)
    cfg = config.IngestConfig(tokenizer="bytes", pack_length=65, shard_size="150KB", dedup="exact")
    run(IngestJob(sources=[str(root / "corpus")], out=str(root / "ds"), config=cfg))
    return str(root / "ds")


@pytest.fixture(scope="session")
def baseline(token_dataset, tmp_path_factory):
    """An uninterrupted run: the reference weights."""
    from helpers import tiny, train

    run_dir = tmp_path_factory.mktemp("baseline")
    summary = train(tiny(token_dataset), run_dir)
    assert summary["attempts"] == 1 and summary["failures"] == []
    return run_dir
