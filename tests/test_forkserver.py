"""The fork server (petatrain.runtime.startup.forkserver): Ray worker processes forked from one process
per node that imported a rank's modules once, behaving as the processes Ray would have started."""

from __future__ import annotations

import array
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from petatrain.config import JobConfig
from petatrain.runtime import trainer
from petatrain.runtime.startup import forkserver

SHIM = forkserver.__file__


def _server_of(pid: int) -> str:
    """The command line of `pid`'s parent."""
    with open(f"/proc/{pid}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _shims() -> set[int]:
    """Live shim processes (this file run with -I -S)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[1:3] == [b"-I", b"-S"] and argv[3].decode() == SHIM:
            found.add(int(pid))
    return found


def test_ranks_start_forked_from_one_server_as_ray_would_start_them(ray_local, tmp_path):
    """Two actors of the worker group's runtime environment: forked from the node's one server, each with
    its own Ray IDs and numpy draws and the environment's variables; a killed actor's shim exits, and a
    killed shim's worker ends; a request for anything but Ray's worker script, or a malformed one, is
    refused and the server goes on serving."""
    ray = ray_local
    cfg = JobConfig()
    env = trainer.worker_runtime_env(cfg, local=True)
    assert env["py_executable"] == forkserver.py_executable()
    env["env_vars"]["PETATRAIN_TEST_GROUP"] = uuid.uuid4().hex  # a server of its own: this environment is new

    @ray.remote(num_cpus=0)
    class Rank:
        def facts(self):
            import numpy as np

            from petatrain.runtime._ray import random_id

            return {
                "pid": os.getpid(),
                "cpu_s": time.process_time(),
                "ray_id": random_id().hex(),
                "numpy": float(np.random.random()),
                "env": dict(os.environ),
                "raylet_socket": next(a for a in sys.argv if a.startswith("--raylet-name=")).split("=", 1)[1],
            }

    before = _shims()
    ranks = [Rank.options(runtime_env=env).remote() for _ in range(2)]
    facts = ray.get([r.facts.remote() for r in ranks], timeout=180)
    servers = {_server_of(f["pid"]) for f in facts}
    assert len(servers) == 1 and "forkserver import serve" in servers.pop(), "both forked from one server"
    cpu = [f["cpu_s"] for f in facts]  # a process Ray starts spends ~4 s in the warm-up hook's imports alone
    assert max(cpu) < 2.0, f"a forked worker does not import torch, TorchDynamo and Ray Train again: {cpu} s"
    assert facts[0]["ray_id"] != facts[1]["ray_id"], "each child seeds Ray's ID generator itself"
    assert facts[0]["numpy"] != facts[1]["numpy"], "numpy's global generator is reseeded in each child"
    for name, value in env["env_vars"].items():  # the runtime environment's variables, as in any Ray worker
        assert {f["env"].get(name) for f in facts} == {value}
    shims = _shims() - before
    assert len(shims) == 2, "one shim stays the raylet's child for each forked worker"

    ray.kill(ranks[0])
    deadline = time.monotonic() + 20
    while len(_shims() & shims) > 1:
        assert time.monotonic() < deadline, "a killed worker's shim exits with it"
        time.sleep(0.1)

    # The server's socket (its last argument), beside the raylet's; this user's process asking for another script
    path = _server_of(facts[1]["pid"]).split()[-1]  # facts[0]'s actor is killed
    assert os.path.dirname(path) == os.path.dirname(facts[0]["raylet_socket"])
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    refused = _ask(path, {"argv": [sys.executable, "-c", "print('x')"], "env": {}, "cwd": "/", "shim": os.getpid()})
    assert refused.startswith("not Ray's worker script"), refused
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # a malformed request
        conn.connect(path)
        conn.sendall((5).to_bytes(8, "big") + b"{oops")
        assert conn.recv(200).decode().startswith("bad request")
    again = Rank.options(runtime_env=env).remote()  # the server still serves
    assert _server_of(ray.get(again.facts.remote(), timeout=120)["pid"]) == _server_of(facts[1]["pid"])
    ray.kill(again)

    # The raylet ends a worker by killing its process group, the shim's: the forked worker goes with it
    (shim,) = _shims() & shims
    os.kill(shim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _state(facts[1]["pid"]) not in ("Z", "gone"):
        assert time.monotonic() < deadline, "a worker whose shim was killed ends with it"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _ask(path: str, request: dict) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        data = json.dumps(request).encode()
        conn.sendall(len(data).to_bytes(8, "big"))
        with open(os.devnull) as null:
            fd = null.fileno()
            conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 3))])
        return conn.recv(200).decode().strip()


@pytest.mark.parametrize(
    "argv",
    [
        ["--node-id=x"],  # no raylet socket to find a server beside
        [f"--raylet-name=/tmp/{'x' * 120}/sockets/raylet"],  # a socket path too long for AF_UNIX
    ],
    ids=["no-raylet", "long-path"],
)
def test_without_a_server_the_shim_runs_the_worker_itself(tmp_path, argv):
    """Whatever keeps the shim from its server, the worker starts as Ray would have started it: the shim
    execs Python on the same arguments, and says why on stderr."""
    script = tmp_path / "worker.py"
    script.write_text("import sys; print('ran', *sys.argv[1:])")
    done = subprocess.run(
        [sys.executable, "-I", "-S", SHIM, str(script), *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ran {' '.join(argv)}"
    assert "petatrain fork server: not used" in done.stderr and "starts on its own" in done.stderr


def test_a_joined_clusters_node_without_this_python_starts_its_worker_with_python(tmp_path, monkeypatch):
    """On a cluster the driver joined, the executable is guarded: run as Ray runs it on a node (`bash -c
    "exec <py_executable> ARGS"`, ray._private.runtime_env.context), a node with this Python and this
    file runs the shim, and one without them runs `python` on the same arguments. Through Ray Client
    the driver's paths are its own: no fork server."""
    cfg = JobConfig()
    assert trainer.worker_runtime_env(cfg, local=False)["py_executable"] == forkserver.py_executable(guarded=True)
    assert "py_executable" not in trainer.worker_runtime_env(cfg, local=False, client=True)
    script = tmp_path / "worker.py"
    script.write_text("import sys; print('ran', sys.executable, *sys.argv[1:])")
    args = [str(script), "--node-id=x", "it's"]  # no raylet socket: the shim runs it itself, and says so
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

    def run_on_node() -> subprocess.CompletedProcess:
        command = " ".join(["exec", forkserver.py_executable(guarded=True), *map(shlex.quote, args)])
        env = os.environ | {"PATH": path}
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=60)

    done = run_on_node()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ran", sys.executable, *args[1:]]
    assert "petatrain fork server: not used" in done.stderr
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    done = run_on_node()
    assert done.returncode == 0, done.stderr
    ran = done.stdout.split()
    assert ran[0] == "ran" and ran[2:] == args[1:] and "no-such-python" not in ran[1]
    assert "fork server" not in done.stderr
