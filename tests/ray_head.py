"""A Ray head node started as `ray start --head` starts one on a cluster, with its Ray Client
server, on 127.0.0.1 and free ports, with token authentication and a token of its own.

    with RayHead() as head:
        head.client_address   # ray://127.0.0.1:PORT
        head.gcs_address      # 127.0.0.1:PORT
        head.client_env       # RAY_AUTH_MODE=token and the token, for a driver

Every process `ray start` leaves behind shares one session (its own, `start_new_session`), so
stopping kills that session and nothing else (`ray stop` would stop every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class RayHead:
    def __init__(self, cpus: int = 2):
        self.cpus = cpus
        self.token = secrets.token_hex(16)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="pt-head-", dir="/tmp"))  # Ray's socket paths: < 108 bytes
        self.gcs_port, self.client_port, *self._other_ports = free_ports(9)
        self.gcs_address = f"127.0.0.1:{self.gcs_port}"
        self.client_address = f"ray://127.0.0.1:{self.client_port}"
        self.client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        self._session: int | None = None

    def start(self) -> RayHead:
        dashboard, agent, agent_grpc, runtime_env, metrics, objects, node = self._other_ports
        argv = [
            str(Path(sys.executable).with_name("ray")), "start", "--head", "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}", f"--ray-client-server-port={self.client_port}",
            f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
            f"--metrics-export-port={metrics}", f"--object-manager-port={objects}", f"--node-manager-port={node}",
            f"--num-cpus={self.cpus}", f"--temp-dir={self.temp_dir}", "--object-store-memory=200000000",
            "--include-dashboard=false", "--disable-usage-stats",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(self.client_env, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        # As `deploy k8s` starts a head: without it, the Ray Client server's per-driver process,
        # forked while gRPC threads run, dies in about one connection in four (see runtime/cluster.py).
        env["GRPC_ENABLE_FORK_SUPPORT"] = "0"
        log = self.temp_dir / "ray-start.log"  # a file, not a pipe: the daemons would hold a pipe open
        with log.open("wb") as out:
            started = subprocess.Popen(argv, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        self._session = started.pid
        if started.wait(timeout=120) != 0:
            text = log.read_text(errors="replace")[-3000:]
            self.stop()
            raise RuntimeError(f"ray start failed ({started.returncode}):\n{text}")
        return self

    def driver_env(self, **extra: str) -> dict[str, str]:
        """This process's environment without Ray's variables, plus `extra`: what a driver outside sees."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, **extra}

    def stop(self) -> None:
        if self._session is None:
            return
        # A test cluster's state goes with it: a second for a clean exit, then no more waiting.
        for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._session, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _alive(self._session):
                time.sleep(0.2)
            if not _alive(self._session):
                break
        self._session = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(session: int) -> bool:
    """A process of the session still runs (zombies, waiting for init to reap them, do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:  # state, ppid, pgrp, session
            return True
    return False
