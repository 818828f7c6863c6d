"""Ray driver for tests/test_netns.py; runs in the head's namespace of a TwoNodeCluster.

Talks to the test over stdout (one JSON object per line) and stdin (one line per go-ahead):
  ready   an actor is on the worker node with a call in flight; the test cuts the link
  lost    when the head saw the node dead and when the call failed (wall-clock times)
"""

import json
import sys
import time

import ray

from petatrain.chaos.netns import WORKER_RESOURCE

WATCH_S = 30.0


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


@ray.remote(num_cpus=0, resources={WORKER_RESOURCE: 1}, max_restarts=0)
class Probe:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def watch(node_id: str, call: ray.ObjectRef) -> dict:
    """Poll until the head marks `node_id` dead and `call` fails (or WATCH_S passes)."""
    dead_at = failed_at = error = None
    deadline = time.time() + WATCH_S
    while (dead_at is None or failed_at is None) and time.time() < deadline:
        if dead_at is None and not alive(node_id):
            dead_at = time.time()
        if failed_at is None:
            done, _ = ray.wait([call], timeout=0.1)
            if done:
                try:
                    ray.get(done[0])
                    error = "call returned"
                except Exception as e:
                    error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
                failed_at = time.time()
    return {"dead_at": dead_at, "failed_at": failed_at, "error": error}


def main() -> None:
    ray.init(logging_level="WARNING")  # RAY_ADDRESS comes from TwoNodeCluster.env
    probe = Probe.remote()
    node = ray.get(probe.node_id.remote(), timeout=60)
    call = probe.sleep.remote(600)
    emit(phase="ready", node=node, head=ray.get_runtime_context().get_node_id())
    sys.stdin.readline()  # the test has cut the link
    emit(phase="lost", **watch(node, call))


if __name__ == "__main__":
    main()
