"""The driver's health endpoint: liveness that fails when training stops advancing, readiness that
says whether the run trains, checkpoints or restarts. Probed with a real HTTP client; through a
hang and three other restarts in test_train_faults.py's every-fault run."""

from __future__ import annotations

import requests

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
