"""Two Ray nodes on one machine, the second behind a link a test can cut (fault 4, network).

`TwoNodeCluster` puts a Ray head in one network namespace and a Ray worker node in another,
joined by a veth pair whose private addresses exist only inside the two namespaces; the
host's own interfaces are never touched. `cut()` takes the link down, as a switch failure
would; `cut_own_link()` is the same fault injected from inside: a training worker on the
second node calls it for `--inject partition@step=N,rank=R`.

Drivers run inside the head's namespace (`cluster.popen([...])` / `cluster.run([...])`,
which prefix `ip netns exec HEAD` and add `cluster.env`), because the head's address is
reachable only there. `cluster.env` carries `RAY_ADDRESS`, so `ray.init()` with no address,
or `petatrain train --address $RAY_ADDRESS`, joins this cluster. Ray Train's controller is
pinned to the driver's node, so it stays on the head and survives the cut.

Each namespace has its own ports, so this cluster never collides with a Ray on the host or
with another `TwoNodeCluster`. Processes are found by namespace membership (`ip netns
pids`), never by name: `ray stop` would kill every Ray on the machine.

Measured on the 2-core Debian 12 machine (Ray 2.60, 1 CPU per node, other jobs sharing it):
- start (namespaces, link, head, worker node): 5.5-10 s (head ~3.6 s, worker ~1.8 s idle);
  `restart_worker()` ~2-3 s;
- cut to node marked dead at the head, with `FAST_HEALTH_CHECK`: 5.9 s every time (3 missed
  1 s checks plus the one in flight); with Ray's defaults ~63 s. An actor call on the lost
  node fails with `ActorDiedError` ("health check failed due to missing too many
  heartbeats") at the same moment. `cut_own_link()` from an actor on the node: also 5.9 s;
- `TorchTrainer`, 2 gloo workers (one per node) all-reducing in a loop, link cut
  (benchmarks/partition_train.py): Ray Train's own worker health check sees the dead actor
  and `fit()` raises `WorkerGroupError` ("A worker health check failed", the lost rank
  named) 5.9-6.8 s after the cut with `max_failures=0`. `TorchConfig(timeout_s=10)` changes
  nothing (6.9 s): the rank on the head, stuck in the all-reduce, is killed by the
  controller, not released by gloo's timeout. Elastic, `num_workers=(1, 2)`,
  `max_failures=1`: the first restart still asks for 2 workers (the elastic policy's
  resource view holds the lost node), waits out `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`
  (60 s), then restarts at world size 1: training resumes 70-72 s after the cut, or 21-23 s with
  that variable set to 10 in the driver's environment (Ray Train passes it on).
- gloo needs `GLOO_SOCKET_IFNAME` (set in `cluster.env`, inherited by every Ray worker):
  without it ranks advertise 127.0.0.1 and cannot reach each other across nodes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self

from petatrain import constants
from petatrain.errors import PetatrainError

logger = logging.getLogger(__name__)

NETNS_PREFIX = "pt-"
# pt-<creator pid>-<serial>-head|work; the pid lets a later run reap what a killed one left.
_NETNS_NAME = re.compile(r"^pt-(?P<pid>\d+)-(?P<serial>\d+)-(?P<role>head|work|probe)$")
NETNS_DIR = Path("/run/netns")
WORKER_RESOURCE = "netns_worker"  # custom resource that places actors on the second node

# Ray marks a node dead after `threshold` missed checks: ~6 s instead of the default ~63 s.
FAST_HEALTH_CHECK = constants.FAST_HEALTH_CHECK
_HEAD_PORT = 6379
# Must lie outside Ray's worker port range 10002-19999; free inside our namespaces.
_METRICS_EXPORT_PORT = 20001
# Interface names are per namespace, so both ends of the veth can share one fixed name, and
# GLOO_SOCKET_IFNAME can name it on both nodes: without it gloo binds to whatever the hostname
# resolves to (127.0.0.1 here) and ranks on different nodes cannot connect.
LINK_IF = "pt-link"

Node = Literal["head", "work"]
_serial = 0


class PartitionRefusedError(PetatrainError):
    """`cut_own_link()` was called outside a namespace this harness created."""


class ClusterStartError(PetatrainError):
    """A node of the two-node test cluster did not start; the message has Ray's output."""


def _ip() -> str:
    # Ray workers may run with a PATH that lacks /usr/sbin.
    found = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)
    if found is None:
        raise PetatrainError("the `ip` command is missing: apt-get install -y iproute2")
    return found


def _sh(argv: Sequence[str], *, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise PetatrainError(
            f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def netns_available() -> str | None:
    """None if this process can create network namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        ip = _ip()
    except PetatrainError as e:
        return str(e)
    probe = f"{NETNS_PREFIX}{os.getpid()}-0-probe"
    made = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run([ip, "netns", "delete", probe], capture_output=True)
    return None


def _netns_pids(name: str) -> list[int]:
    done = subprocess.run([_ip(), "netns", "pids", name], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Field 3, after the parenthesised command name, is the state; Z is a zombie.
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _kill_namespace_processes(*names: str, grace_s: float = 2.0) -> None:
    """SIGTERM every process in the namespaces `names`, SIGKILL what is left after `grace_s` (at
    once where it is 0)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if sig == signal.SIGTERM and not grace_s:
            continue
        pids = [p for name in names for p in _netns_pids(name) if _running(p)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _running(p)]
            time.sleep(0.05)
        if not pids:
            return
    logger.warning("processes %s in network namespaces %s survived SIGKILL", pids, names)


def _delete_namespace(name: str) -> None:
    _kill_namespace_processes(name)
    # Deleting a namespace also destroys the veth end inside it, and with it the peer.
    subprocess.run([_ip(), "netns", "delete", name], capture_output=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_clusters() -> list[str]:
    """Delete namespaces (and kill their processes) left by a harness process that died."""
    reaped = []
    names = sorted(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else []
    for name in names:
        m = _NETNS_NAME.match(name)
        if m is None or int(m["pid"]) == os.getpid() or _pid_alive(int(m["pid"])):
            continue
        _delete_namespace(name)
        shutil.rmtree(f"/tmp/{NETNS_PREFIX}{m['pid']}-{m['serial']}", ignore_errors=True)
        reaped.append(name)
    if reaped:
        logger.warning("reaped network namespaces left by dead test runs: %s", reaped)
    return reaped


class TwoNodeCluster:
    """A Ray head in one network namespace and a worker node in another, joined by a cuttable link.

    with TwoNodeCluster() as cluster:
        driver = cluster.popen([sys.executable, "driver.py"])   # runs in the head's namespace
        ...
        cluster.cut()

    The worker node carries the custom resource `WORKER_RESOURCE` (1 unit) to place actors on it.
    """

    def __init__(
        self,
        *,
        head_cpus: int = 1,
        worker_cpus: int = 1,
        worker_resources: Mapping[str, float] | None = None,
        object_store_mb: int = 200,
        health_check: Mapping[str, int] | None = None,
        subnet: str = "10.231.0",
        keep_logs: bool = False,
        node_env: Mapping[str, str] | None = None,
        head_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
    ) -> None:
        if head_cpus < 0 or worker_cpus < 0:
            raise ValueError(f"head_cpus and worker_cpus must be >= 0, got {head_cpus} and {worker_cpus}")
        if object_store_mb < 80:
            raise ValueError(f"object_store_mb={object_store_mb} is below Ray's minimum; use 80 or more")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be the first three octets of a /24, like '10.231.0', got {subnet!r}")
        global _serial
        _serial += 1
        tag = f"{NETNS_PREFIX}{os.getpid()}-{_serial}"
        self.head_ns, self.worker_ns = f"{tag}-head", f"{tag}-work"
        self.temp_root = Path("/tmp") / tag  # short: Ray's socket paths must stay under 108 bytes
        self.head_ip, self.worker_ip = f"{subnet}.1", f"{subnet}.2"
        self.address = f"{self.head_ip}:{_HEAD_PORT}"
        self.head_cpus, self.worker_cpus = head_cpus, worker_cpus
        self.worker_resources = {WORKER_RESOURCE: 1, **(worker_resources or {})}
        self.object_store_bytes = object_store_mb * 1024 * 1024
        self.health_check = dict(FAST_HEALTH_CHECK if health_check is None else health_check)
        self.keep_logs = keep_logs
        # Addresses never leave the namespaces, so the token only guards against other local users.
        token = secrets.token_hex(16)
        self.env = {
            constants.RAY_ADDRESS_ENV: self.address,
            constants.RAY_AUTH_MODE_ENV: "token",
            constants.RAY_AUTH_TOKEN_ENV: token,
            "GLOO_SOCKET_IFNAME": LINK_IF,  # Ray workers inherit the raylet's environment
            "NCCL_SOCKET_IFNAME": LINK_IF,
        }
        # The nodes' `ray start` only (e.g. Ray's TLS variables); drivers are given theirs by the caller.
        self.node_env = dict(node_env or {})
        # More `ray start` flags per node (a pod's rayStartParams): `--name=value` replaces the harness's own.
        self.head_args, self.worker_args = list(head_args), list(worker_args)
        self._forwarders: list[socket.socket] = []
        self.start_s: float | None = None
        self._worker_starts = 0
        self._started = False

    # lifecycle

    def start(self) -> Self:
        """Create the namespaces and the link, start the head and the worker node."""
        if self._started:
            raise RuntimeError("this TwoNodeCluster is already started; make a new one")
        reason = netns_available()
        if reason is not None:
            raise PetatrainError(f"cannot build the two-node test cluster: {reason}")
        reap_stale_clusters()
        self._started = True
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            self._make_link()
            self._start_head()
            self._start_worker()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        logger.info("two-node Ray cluster %s up in %.1f s", self.address, self.start_s)
        return self

    def stop(self) -> None:
        """Kill every process in both namespaces, delete them (and the link) and the temp dirs."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        for listener in self._forwarders:
            with contextlib.suppress(OSError):
                listener.close()
        # Both nodes at once, killed outright: nothing in them is kept (a SIGTERMed Ray head waited
        # 2 s for its autoscaler monitor, whose handler calls the GCS stopping beside it). With
        # `keep_logs`, SIGTERM first, so the processes' logs end as they would.
        _kill_namespace_processes(self.worker_ns, self.head_ns, grace_s=2.0 if self.keep_logs else 0)
        for name in (self.worker_ns, self.head_ns):
            _delete_namespace(name)
        if not self.keep_logs:
            shutil.rmtree(self.temp_root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # running things inside

    def command(self, argv: Sequence[str], *, node: Node = "head") -> list[str]:
        """`argv` prefixed to run in the head's (or the worker's) namespace."""
        return [_ip(), "netns", "exec", self.head_ns if node == "head" else self.worker_ns, *argv]

    def popen(self, argv: Sequence[str], *, node: Node = "head", env: Mapping[str, str] | None = None, **kw: Any):
        """Start `argv` in a namespace with `self.env`; a driver runs in the head's (the default)."""
        return subprocess.Popen(self.command(argv, node=node), env={**os.environ, **self.env, **(env or {})}, **kw)

    def run(
        self, argv: Sequence[str], *, node: Node = "head", env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.CompletedProcess:
        """Like `popen`, but waits: `subprocess.run` in a namespace with `self.env`."""
        return subprocess.run(self.command(argv, node=node), env={**os.environ, **self.env, **(env or {})}, **kw)

    def pids(self) -> dict[str, list[int]]:
        """Live processes per namespace (for checks that nothing is left behind)."""
        return {name: [p for p in _netns_pids(name) if _running(p)] for name in (self.head_ns, self.worker_ns)}

    def expose(self, target: str, port: int) -> str:
        """Make a TCP service of the host (e.g. the S3 server at 127.0.0.1:7480) reachable from both
        nodes at `HEAD_IP:port`; returns that address. A forwarder in this process: its listening
        socket is made inside the head's namespace (by a thread that enters it alone), and each
        connection it accepts is relayed to `target` from the host's namespace."""
        host, _, target_port = target.rpartition(":")
        listener = _listen_in(self.head_ns, self.head_ip, port)
        self._forwarders.append(listener)

        def relay(conn: socket.socket) -> None:
            try:
                upstream = socket.create_connection((host, int(target_port)), timeout=10)
            except OSError:
                conn.close()
                return
            upstream.settimeout(None)
            sending = threading.Thread(target=_pump, args=(conn, upstream), daemon=True)
            sending.start()
            _pump(upstream, conn)
            sending.join()
            conn.close()
            upstream.close()

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:  # closed by stop()
                    return
                threading.Thread(target=relay, args=(conn,), daemon=True).start()

        threading.Thread(target=serve, name=f"expose-{port}", daemon=True).start()
        return f"{self.head_ip}:{port}"

    # faults

    def cut(self) -> None:
        """Take both ends of the link down: each node stops hearing the other at once."""
        _sh([_ip(), "-n", self.worker_ns, "link", "set", "dev", LINK_IF, "down"])
        _sh([_ip(), "-n", self.head_ns, "link", "set", "dev", LINK_IF, "down"])

    def restore(self) -> None:
        """Bring the link back up. A node the head declared dead does not come back: see `restart_worker`."""
        _sh([_ip(), "-n", self.head_ns, "link", "set", "dev", LINK_IF, "up"])
        _sh([_ip(), "-n", self.worker_ns, "link", "set", "dev", LINK_IF, "up"])

    def restart_worker(self) -> None:
        """Start a fresh worker node (a partitioned one cannot rejoin) on the restored link.

        The old node's processes are killed while the link is still down, as a replaced machine's
        would be: killed after it, a rank blocked in a run-hub call during the partition gets its
        answer once the link is up and can fire its own `partition` spec, cutting the link again
        under the new node's `ray start` (seen in CI: the start waited 120 s for the GCS)."""
        _kill_namespace_processes(self.worker_ns)
        self.restore()
        self._start_worker()

    # internals

    def _make_link(self) -> None:
        ip = _ip()
        for name in (self.head_ns, self.worker_ns):
            _sh([ip, "netns", "add", name])
            _sh([ip, "-n", name, "link", "set", "dev", "lo", "up"])
        # Created inside the head namespace with its peer moved straight into the worker's:
        # neither end ever exists in the host namespace.
        _sh(
            [
                ip,
                "-n",
                self.head_ns,
                *f"link add {LINK_IF} type veth peer name {LINK_IF} netns {self.worker_ns}".split(),
            ]
        )
        for name, addr in ((self.head_ns, self.head_ip), (self.worker_ns, self.worker_ip)):
            _sh([ip, "-n", name, "addr", "add", f"{addr}/24", "dev", LINK_IF])
            _sh([ip, "-n", name, "link", "set", "dev", LINK_IF, "up"])

    def _ray_start(self, node: Node, args: list[str], temp_dir: Path) -> None:
        temp_dir.parent.mkdir(parents=True, exist_ok=True)
        ray = str(Path(sys.executable).with_name("ray"))
        extra = self.head_args if node == "head" else self.worker_args
        replaced = {a.split("=", 1)[0] for a in extra}
        args = [a for a in args if a.split("=", 1)[0] not in replaced] + extra
        argv = [
            ray, "start", *args,
            f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={temp_dir}",
            f"--metrics-export-port={_METRICS_EXPORT_PORT}",
            "--disable-usage-stats",
        ]  # fmt: skip
        env = {constants.RAY_USAGE_STATS_ENV: "0", **self.node_env}
        done = self.run(argv, node=node, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise ClusterStartError(
                f"`ray start` on the {node} node failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )

    def _start_head(self) -> None:
        self._ray_start(
            "head",
            [
                "--head",
                f"--node-ip-address={self.head_ip}",
                f"--port={_HEAD_PORT}",
                f"--num-cpus={self.head_cpus}",
                "--include-dashboard=false",
                f"--system-config={json.dumps(self.health_check)}",
            ],
            self.temp_root / "head",
        )

    def _start_worker(self) -> None:
        self._worker_starts += 1
        self._ray_start(
            "work",
            [
                f"--address={self.address}",
                f"--node-ip-address={self.worker_ip}",
                f"--num-cpus={self.worker_cpus}",
                f"--resources={json.dumps(self.worker_resources)}",
            ],
            self.temp_root / f"work{self._worker_starts}",
        )


_CLONE_NEWNET = 0x40000000


def _listen_in(namespace: str, ip: str, port: int) -> socket.socket:
    """A listening TCP socket on ip:port inside network namespace `namespace`. setns(2) moves only
    the calling thread, so a short-lived thread enters the namespace, makes the socket and ends;
    the socket stays in the namespace it was made in."""
    made: dict[str, Any] = {}

    def inside() -> None:
        fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((ip, port))
            listener.listen(64)
            made["socket"] = listener
        except OSError as exc:
            made["error"] = exc
        finally:
            os.close(fd)

    thread = threading.Thread(target=inside, name=f"listen-in-{namespace}")
    thread.start()
    thread.join()
    if "error" in made:
        raise PetatrainError(f"cannot listen on {ip}:{port} in {namespace}: {made['error']}")
    return made["socket"]


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes until `source` ends, then end `sink`'s sending side."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _own_namespace() -> str | None:
    """Name of the /run/netns entry for this process's network namespace, None if it has none."""
    own = os.stat("/proc/self/ns/net")
    names = sorted(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else []
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(NETNS_DIR / name)
            if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                return name
    return None


def on_cuttable_node() -> bool:
    """True in a TwoNodeCluster worker namespace, the only place `partition` acts."""
    match = _NETNS_NAME.match(_own_namespace() or "")
    return match is not None and match["role"] == "work"


def cut_own_link() -> list[str]:
    """Partition the node this process runs on: take its non-loopback interfaces down.

    Only inside a network namespace made by `TwoNodeCluster`; anywhere else (the host, a
    container's own namespace) it raises `PartitionRefusedError` and changes nothing.
    Returns the interfaces it took down.
    """
    own = os.stat("/proc/self/ns/net")
    try:
        host = os.stat("/proc/1/ns/net")
    except OSError:
        host = None  # pid 1 is unreadable in some sandboxes (this one); the name check below still holds
    if host is not None and (own.st_dev, own.st_ino) == (host.st_dev, host.st_ino):
        raise PartitionRefusedError(
            "refusing to cut the network: this process is in the host's network namespace; "
            "the partition injector only runs on a node started by petatrain.chaos.netns.TwoNodeCluster"
        )
    # Only a namespace the harness made and named has a pt-<pid>-<n>-head|work entry in /run/netns.
    name = _own_namespace()
    match = _NETNS_NAME.match(name or "")
    if match is None or match["role"] == "probe":
        raise PartitionRefusedError(
            "refusing to cut the network: this process's network namespace "
            f"({name or 'no name: the host, or a container'}) was not made by TwoNodeCluster "
            f"(expected a name like {NETNS_PREFIX}<pid>-<n>-work in {NETNS_DIR})"
        )
    ip = _ip()
    links = _sh([ip, "-o", "link", "show"]).stdout.splitlines()
    # "2: pt-work@if3: <BROADCAST,...> ..." -> "pt-work"
    devices = [line.split(":")[1].strip().split("@")[0] for line in links if ":" in line]
    cut = [dev for dev in devices if dev != "lo"]
    for dev in cut:
        _sh([ip, "link", "set", "dev", dev, "down"])
    logger.warning("partition injected: took %s down in network namespace %s", cut, name)
    return cut
