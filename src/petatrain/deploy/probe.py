"""The head pod's probes: `python -m petatrain.deploy.probe live|ready [HEALTH_PORT]`.

KubeRay's default head probes ask Ray whether the raylet and the GCS answer (with wget, which
not every image has). These ask the same with the standard library only, and the liveness
probe also asks the training driver's /livez (runtime/health.py): the pod is restarted when
training stopped advancing, not only when Ray stopped answering. A pod with no driver yet
(a RayJob submits its entrypoint after the head is ready) or any more has nothing listening on
the health port: that passes, Ray's own checks decide. Readiness stays Ray's own: a head
taken out of its Service while a run restarts would cut the RayJob's submitter off it and
turn an in-run restart into a retry of the whole cluster. Exit status 0 is healthy.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

RAYLET = "http://127.0.0.1:52365/api/local_raylet_healthz"
GCS = "http://127.0.0.1:8265/api/gcs_healthz"
HEALTH_PORT = 8079  # observe.health_port in the manifests petatrain writes


def _get(url: str, timeout_s: float) -> tuple[int | None, bytes]:
    """(HTTP status, body); status None when nothing answered (refused, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return None, b""


def check(kind: str, health_port: int = HEALTH_PORT) -> str:
    """ "" when healthy, else why not (one line)."""
    for url, timeout_s in ((RAYLET, 2.0), (GCS, 10.0)):
        status, body = _get(url, timeout_s)
        if status != 200 or b"success" not in body:
            return f"{url}: {status or 'no answer'}"
    if kind == "live":
        status, body = _get(f"http://127.0.0.1:{health_port}/livez", 5.0)
        if status is not None and status != 200:  # a driver answered: training does not advance
            return f"training does not advance: {body.decode(errors='replace')[:300]}"
    return ""


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("live", "ready"):
        print("usage: python -m petatrain.deploy.probe live|ready [HEALTH_PORT]", file=sys.stderr)
        return 2
    problem = check(argv[0], int(argv[1]) if len(argv) > 1 else HEALTH_PORT)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
