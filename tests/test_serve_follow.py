"""petatrain serve --follow: a run that commits a new checkpoint while being served."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

pytestmark = pytest.mark.slow


def test_follow_switches_to_a_newly_committed_checkpoint_without_failing_a_request(baseline, tmp_path):
    """Served from step 20 (the newest then); step 30 is committed as a writer commits it (files,
    then state.json, then COMMITTED): the replica switches to it while a client keeps asking, and
    every request succeeds. A refused --follow without --checkpoint latest is one line."""

    import requests

    from petatrain import api
    from petatrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--follow switches to each new checkpoint: use --checkpoint latest"):
        api.serve(str(baseline), follow=True)
    run = tmp_path / "run"
    shutil.copytree(baseline, run, ignore=shutil.ignore_patterns("step-00000030"))
    port = _free_port()
    fast = ["serve.follow_poll_s=0.5", "serve.cpus_per_replica=0"]
    serving = api.serve(str(run), checkpoint="latest", follow=True, port=port, overrides=fast)
    statuses: list[int] = []
    stop = threading.Event()
    client = _asking(serving.url, statuses, stop)

    def step() -> int:
        return requests.get(f"{serving.url}/v1/models", timeout=30).json()["data"][0]["step"]

    worker = threading.Thread(target=client)
    try:
        assert step() == 20
        worker.start()
        source, target = baseline / "checkpoints" / "step-00000030", run / "checkpoints" / "step-00000030"
        target.mkdir()
        for item in sorted(source.iterdir(), key=lambda p: p.name == "COMMITTED"):  # COMMITTED last
            shutil.copy(item, target / item.name)
        deadline = time.monotonic() + 60
        while step() != 30 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert step() == 30
        time.sleep(1)  # requests on the new weights too
    finally:
        stop.set()
        worker.join(timeout=60)
        api.stop_serving()
    assert len(statuses) > 5 and set(statuses) == {200}, statuses


def test_serving_a_registered_model_follows_its_alias_with_no_failed_request(baseline, tmp_path):
    """registry://tiny@champion is served; a rollback moves the alias and every replica switches
    while a client keeps asking, every request answered; a version whose weights are not those its
    record names is skipped and the version served goes on serving."""

    import calendar

    import requests

    from petatrain import api
    from petatrain.registry.store import Registry

    reg = str(tmp_path / "registry")
    first = api.promote(str(baseline), "tiny", registry=reg)  # final, step 30
    second = api.promote(str(baseline), "tiny", checkpoint="20", registry=reg, force=True)
    assert (first["step"], second["step"], second["checkpoint"]) == (30, 20, "20")
    port = _free_port()
    fast = ["serve.follow_poll_s=0.5", "serve.cpus_per_replica=0"]
    serving = api.serve("registry://tiny@champion", follow=True, port=port, overrides=fast, registry=reg)
    statuses: list[int] = []
    stop = threading.Event()
    client = _asking(serving.url, statuses, stop)

    def card() -> dict:
        return requests.get(f"{serving.url}/v1/models", timeout=30).json()["data"][0]

    worker = threading.Thread(target=client)
    try:
        assert (card()["id"], card()["version"], card()["step"], card()["alias"]) == ("tiny", 2, 20, "champion")
        assert card()["lineage"][0]["step"] == 30 and "run" not in card()
        # What it was trained on, and its staleness once it answered (the commit to its first answer).
        committed = card()["data_committed"]
        assert card()["data_version"] == 1 and committed and card()["staleness_s"] is None
        requests.post(f"{serving.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        stale = card()["staleness_s"]
        assert 0 < stale < time.time() - calendar.timegm(time.strptime(committed, "%Y-%m-%dT%H:%M:%SZ")) + 1
        worker.start()
        api.rollback("tiny", registry=reg)
        deadline = time.monotonic() + 60
        while card()["version"] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (card()["version"], card()["step"]) == (1, 30)
        # A version whose record names other weights than those there: skipped, version 1 serves on.
        Registry(reg).register("tiny", {**first, "checksum": "xxh3-128:" + "0" * 32})
        time.sleep(3)
        assert card()["version"] == 1
    finally:
        stop.set()
        worker.join(timeout=60)
        api.stop_serving()
    assert len(statuses) > 5 and set(statuses) == {200}, statuses


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _asking(url: str, statuses: list[int], stop: threading.Event):
    """A client that keeps asking for a completion until `stop`, each answer's status in `statuses`."""
    import requests

    def client() -> None:
        while not stop.is_set():
            body = {"prompt": "The", "max_tokens": 6, "seed": 1}
            statuses.append(requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code)

    return client
