"""The driver's health endpoint: liveness that fails when training stops advancing, readiness that
says whether the run trains, checkpoints or restarts. Probed with a real HTTP client."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from helpers import ROOT
from petatrain.runtime.health import verdict


def test_liveness_fails_only_after_the_window_without_progress():
    now = 1000.0
    training = {"state": "training", "attempt": 1, "step": 7, "started_t": 900.0, "attempt_t": 950.0}
    assert verdict({**training, "last_step_t": 990.0}, 30, now)["live"]
    stuck = verdict({**training, "last_step_t": 960.0}, 30, now)
    assert not stuck["live"] and stuck["ready"]
    assert stuck["reason"] == "no step completed and no attempt started for 40 s (observe.health_window_s=30)"
    # A new attempt is progress: a restart that places its workers is not a dead run.
    assert verdict({**training, "state": "restarting", "attempt_t": 995.0, "last_step_t": 960.0}, 30, now)["live"]
    # Nothing stepped yet: counted from the driver's start.
    starting = verdict({"state": "starting", "started_t": 950.0}, 30, now)
    assert not starting["live"] and not starting["ready"]
    assert verdict({"state": "finished", "started_t": 0.0, "last_step_t": 1.0}, 30, now)["live"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.chaos
def test_liveness_fails_during_a_hang_and_recovers_with_the_restart(token_dataset, tmp_path, ray_local):
    """A rank hangs (SIGSTOP) at step 6: within observe.health_window_s /livez answers 503 with its
    reason, /readyz says the run restarts once the watchdog ends the hang, then both are 200 again."""
    port = _free_port()
    argv = [
        sys.executable, "-m", "petatrain", "train", str(ROOT / "examples" / "tiny.yaml"),
        "--run-dir", str(tmp_path / "run"), "--address", ray_local.get_runtime_context().gcs_address,
        "--inject", "hang@step=6,rank=1", "--json",
        "--set", f"data.dataset={token_dataset}", "--set", "train.steps=16", "--set", "train.eval_every=0",
        "--set", "faults.hang_timeout_s=8", "--set", f"observe.health_port={port}",
        "--set", "observe.health_window_s=3",
    ]  # fmt: skip
    seen: list[tuple[float, str, int, dict]] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            for path in ("/livez", "/readyz"):
                try:
                    answer = requests.get(f"http://127.0.0.1:{port}{path}", timeout=2)
                    seen.append((time.monotonic(), path, answer.status_code, answer.json()))
                except requests.ConnectionError:
                    pass  # not serving yet, or no more
            time.sleep(0.25)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    finally:
        done.set()
        prober.join()
    assert run.returncode == 0, run.stderr[-3000:]
    live = [(t, code, body) for t, path, code, body in seen if path == "/livez"]
    ready = [(code, body["state"]) for _, path, code, body in seen if path == "/readyz"]
    assert (200, "training") in ready and (503, "restarting") in ready, sorted(set(ready))
    failed = [(t, body) for t, code, body in live if code == 503]
    assert failed, "liveness never failed during the hang"
    # The hang: training, and no step for longer than the window (a short one here: the workers'
    # start-up outlasts 3 s too, and fails it while "starting").
    hung = [(t, body) for t, body in failed if body["state"] == "training"]
    assert hung and hung[0][1]["reason"].endswith("(observe.health_window_s=3)"), failed
    assert any(code == 200 and t > hung[-1][0] for t, code, _ in live), "live again after the restart"


def test_a_hub_that_does_not_answer_is_503_with_a_state_on_both_endpoints():
    """Every body has a state, as the endpoints' contract says: "unknown" while the hub does not answer
    (a client reading body["state"] failed on the one body without it)."""
    from types import SimpleNamespace

    from petatrain.runtime.health import HealthServer

    def silent() -> None:
        raise TimeoutError("no answer")

    server = HealthServer(SimpleNamespace(health=SimpleNamespace(remote=silent)), "127.0.0.1", 0, 30.0)
    try:
        for path in ("/livez", "/readyz"):
            answer = requests.get(server.url + path, timeout=10)
            assert answer.status_code == 503
            assert answer.json()["state"] == "unknown" and "does not answer" in answer.json()["reason"]
    finally:
        server.close()
