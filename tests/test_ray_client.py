"""Driving a cluster from outside it, `--address ray://...` (Ray Client), against a real head node
started with `ray start --head` and its Ray Client server, with token authentication on.

Ingest runs there (its driver as a task on the cluster, its stages shown here as they end), and
a cluster that refuses the driver's token is one line that says what to set, at once.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ROOT
from petatrain.data import index, synth
from petatrain.storage import read_bytes
from ray_head import RayHead

pytestmark = pytest.mark.slow  # a Ray head node of its own and CLI processes that join it

STAGES = ["Ray started", "read, cleaned and signed", "deduplicated", "shards written", "committed"]


@pytest.fixture(scope="module")
def head():
    with RayHead() as started:
        yield started


def petatrain(*args: str, env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "petatrain", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )


@pytest.fixture(scope="module")
def ingested(head, tmp_path_factory):
    """A corpus ingested through the Ray Client address, with paths relative to the CLI's folder
    (the task on the cluster does not share it)."""
    root = tmp_path_factory.mktemp("client")
    corpus = synth.generate(str(root / "raw"), documents=300, files=2, seed=11)
    done = petatrain(
        "ingest", "raw", "--out", "ds", "--dedup", "exact", "--address", head.client_address,
        env=head.driver_env(**head.client_env), cwd=root,
    )  # fmt: skip
    return root, corpus, done


def test_ingest_through_ray_client_runs_on_the_cluster_and_shows_its_stages(ingested, head):
    root, corpus, done = ingested
    assert done.returncode == 0, done.stderr[-3000:]
    assert "core_worker" not in done.stderr and "Traceback" not in done.stderr
    lines = done.stderr.splitlines()  # petatrain's stage lines and nothing else (Ray's server logs go to a file)
    assert [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in lines] == STAGES, done.stderr
    assert all(line.startswith("ingest: ") for line in lines), done.stderr
    dataset = index.open_dataset(str(root / "ds"))
    texts = []
    for path in dataset.shards.column("path").to_pylist():
        texts += pq.read_table(pa.BufferReader(read_bytes(dataset.shard_url(path)))).column("text").to_pylist()
    assert len(texts) == len(set(texts)) == dataset.num_rows > 0  # exact duplicates dropped, on the cluster
    assert {original for original, _ in corpus.exact_pairs} <= set(texts)
    assert head.token not in done.stdout + done.stderr


def test_an_error_raised_on_the_cluster_is_one_line(ingested, head):
    root, _, _ = ingested
    done = petatrain(
        "ingest", "missing/*.jsonl", "--out", "ds2", "--address", head.client_address,
        env=head.driver_env(**head.client_env), cwd=root,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing" in errors[0] and "Traceback" not in done.stderr, done.stderr
    assert not (root / "ds2").exists()


@pytest.mark.parametrize(
    ("verb", "address", "token", "says"),
    [
        # (train checks its dataset before it joins: the module's dataset is text, not packed tokens)
        ("ingest", "gcs", None, "sends no token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"),
        # no --address: RAY_ADDRESS's cluster is joined (as ray.init does), its token checked likewise
        ("ingest", "env", None, "sends no token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"),
        ("ingest", "client", "0" * 32, "refused this process's token (RAY_AUTH_MODE=token): set RAY_AUTH_TOKEN"),
    ],
)
def test_a_cluster_that_refuses_the_token_is_one_line_at_once(ingested, head, verb, address, token, says):
    root, _, _ = ingested
    where = head.client_address if address == "client" else head.gcs_address
    tiny = str(ROOT / "examples" / "tiny.yaml")
    args = ["ingest", "raw", "--out", "ds3"] if verb == "ingest" else ["train", tiny, "--set", "data.dataset=ds"]
    env = head.driver_env(**({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {}))
    if address == "env":
        env["RAY_ADDRESS"] = where
    started = time.monotonic()
    done = petatrain(*args, *(["--address", where] if address != "env" else []), env=env, cwd=root)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: the Ray cluster at {where} "), done.stderr[-3000:]
    assert says in done.stderr and "InvalidAuthToken" not in done.stderr and "Failed to connect" not in done.stderr
    assert head.token not in done.stdout + done.stderr
    assert took < 20, f"{took:.1f} s: the refusal should not wait for Ray's connection retries"
