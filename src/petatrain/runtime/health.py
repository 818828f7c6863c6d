"""The driver's training-aware health endpoint: does the run still advance?

Ray's own health checks (what KubeRay's default probes ask) say that the raylet and the GCS
answer, not that training makes progress. This HTTP endpoint, served by the driver on
`observe.health_host:observe.health_port` (127.0.0.1 by default: a Kubernetes probe runs in
the pod's own network namespace, so loopback reaches it), answers from the run hub, which sees
every rank's step heartbeats and every event of the run:

    GET /livez    200 while the run advances; 503 once no step has completed, and no attempt
                  has started, for `observe.health_window_s` (a wedged driver, a cluster that
                  can no longer place the workers, a hang the watchdog could not end), or when
                  the hub does not answer
    GET /readyz   200 while the run trains or checkpoints; 503 while it starts, restarts or has
                  ended. The body says which: {"state": "training" | "checkpointing" |
                  "starting" | "restarting" | "finished" | "failed", ...}; "unknown" (503 on
                  both) while the run hub does not answer within 5 s

Both answer JSON with the state, the attempt, its newest step and how long ago progress was made.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

READY = ("training", "checkpointing")
ENDED = ("finished", "failed")
HUB_TIMEOUT_S = 5.0


def verdict(status: dict[str, Any], window_s: float, now: float) -> dict[str, Any]:
    """Liveness and readiness from the hub's `health()` answer (a pure function, for tests)."""
    progress = max(status.get("last_step_t") or 0.0, status.get("attempt_t") or 0.0, status.get("started_t") or 0.0)
    idle_s = max(now - progress, 0.0)
    state = status.get("state", "starting")
    live = state in ENDED or idle_s <= window_s
    out = {
        "state": state,
        "attempt": status.get("attempt"),
        "step": status.get("step"),
        "since_progress_s": round(idle_s, 1),
        "live": live,
        "ready": state in READY,
    }
    if not live:
        out["reason"] = (
            f"no step completed and no attempt started for {idle_s:.0f} s (observe.health_window_s={window_s:g})"
        )
    return out


class HealthServer:
    """Serves /livez and /readyz from the run hub until `close()`; `url` is where."""

    def __init__(self, hub: Any, host: str, port: int, window_s: float):
        self.hub, self.window_s = hub, window_s
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, body = server.answer(self.path.split("?", 1)[0])
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("health: " + format, *args)

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.url = f"http://{host}:{self._http.server_address[1]}"
        # serve_forever checks for shutdown every poll_interval: its default 0.5 s was half a second
        # added to the end of every run.
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="petatrain-health", daemon=True
        )
        self._thread.start()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path not in ("/livez", "/readyz"):
            return 404, {"error": f"no such endpoint {path!r}: GET /livez or /readyz"}
        import ray

        try:
            status = ray.get(self.hub.health.remote(), timeout=HUB_TIMEOUT_S)
        except Exception as exc:  # a hub that does not answer: the run cannot be seen to advance
            reason = f"the run hub does not answer: {type(exc).__name__}"
            return 503, {"live": False, "ready": False, "state": "unknown", "reason": reason}
        body = verdict(status, self.window_s, time.time())
        ok = body["live"] if path == "/livez" else body["ready"]
        return (200 if ok else 503), body

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
