"""Rank processes forked from one process per node that imported torch, Ray Train and petatrain once.

A new Ray worker process spends ~3.5-5 s of CPU before its rank can build a model: Python
and Ray start, then torch, TorchDynamo (DDP's and FSDP2's constructors read it) and Ray
Train are imported. Every rank of every attempt paid it, and the spares paid it again. Ray
never reuses an actor's process, so a 2-rank run with one restart imported the same modules
six times over.

Ray starts a worker process as `<py_executable> default_worker.py ARGS` when the worker's
runtime environment names a `py_executable` (a public runtime-environment field). The
worker group's runtime environment names this file, run with `-I -S` (no site packages,
a few milliseconds), as that executable: the *shim*. The shim asks its node's *fork server*
for the worker process:

- The server is started by the first shim that finds none (`_start_server`), listens on a
  socket in the Ray session's `sockets/` directory (mode 0600; a connection from another
  user is refused, `SO_PEERCRED`), and imports what a rank imports (`spares.MODULES`) once.
  It serves one environment: its key is a digest of the worker's environment variables, so
  a worker whose environment differs, another Ray job's included (`RAY_JOB_ID`), gets a
  server of its own. Modules read some variables once, on import: a server shared by two
  jobs had its second job's workers register as the first job's, and Ray ended them.
- For each request it forks: the child takes the shim's stdin, stdout and stderr, working
  directory and environment, reseeds numpy's global generator (Python's `random` reseeds
  itself after a fork), and runs Ray's `default_worker.py` as `__main__`, exactly as Ray
  would have. The worker registers with the raylet by the worker ID in its arguments and
  its own pid.
- The shim stays as the raylet's child for as long as the worker lives, forwards SIGTERM,
  SIGINT and SIGHUP to the worker's process group and exits with its status. The raylet
  ends a worker by signalling the shim's group; the worker ends its own group when its shim
  ends (`_die_with`).
- Ray's core library seeds its random-ID generator on its first use and never after a fork:
  the server's imports must not draw an ID (`_ray.class_ids_from_os`), and it checks that
  two forked probes draw different ones before it serves (`_check_ids_differ`).
- The server ends when the raylet does, or after `IDLE_EXIT_S` without a request and with
  no worker alive.

On a Ray this process started (local runs and the test suite) the nodes are this machine. On a
cluster it joined with an address, this process runs on one of its nodes (Ray's rule for a
driver; KubeRay's pods share an image) and the others usually have the same paths: the
executable checks that the node has this Python and this file and else starts the worker with
`python`, as Ray's container environments do (`py_executable(guarded=True)`). Not through Ray
Client (`ray://`): that driver runs off the cluster, with paths of its own.

Everything here is an optimisation: whatever fails (no server, a refused request, a socket
path too long, a server that died while importing), the shim runs the worker itself, as
Ray would have. The server never initialises CUDA (it checks), so a forked rank can use it.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import select
import shlex
import signal
import socket
import sys
import time

# The shim runs this file with `-I -S`: only the standard library may be imported at the top.

# The server ends after this long without a request and with no worker alive: a job's restarts ask
# within seconds, and a server whose job ended holds its imports' memory (~0.5 GB) until then.
IDLE_EXIT_S = 120.0
CONNECT_WAIT_S = 30.0  # how long a shim waits for a server it started to listen
ANSWER_WAIT_S = 600.0  # how long a shim waits for its process (the server imports first: ~5 s of CPU)
_MAX_SOCKET_PATH = 104  # sun_path is 108 bytes
# The server's `python -c` program (benchmarks/overhead.py finds servers by it in /proc).
SERVER_CODE = "import sys; from petatrain.runtime.startup.forkserver import serve; serve(sys.argv[1])"


def py_executable(*, guarded: bool = False) -> str:
    """The runtime environment's `py_executable`: this file as the shim, with this process's Python.

    `guarded`, for a cluster this process joined (its nodes need not have this file or this Python):
    Ray runs the executable as `bash -c "exec <py_executable> default_worker.py ..."` on the node, and
    a node without either starts its worker with `python`, as Ray's own container and conda
    environments do. A node with both has petatrain installed where this process has it."""
    python, shim_file = sys.executable, os.path.abspath(__file__)
    if not guarded:
        return f"{shlex.quote(python)} -I -S {shlex.quote(shim_file)}"
    script = 'if [ -x "$0" ] && [ -f "$1" ]; then exec "$0" -I -S "$@"; fi; shift; exec python "$@"'
    return f"bash -c {shlex.quote(script)} {shlex.quote(python)} {shlex.quote(shim_file)}"


def available() -> bool:
    """Forking needs Linux (fork, SCM_RIGHTS, pidfd)."""
    return sys.platform == "linux" and hasattr(os, "pidfd_open")


# --- the shim: Ray's worker command ---------------------------------------------------------


def shim(argv: list[str]) -> None:
    """Run Ray's worker `argv` (default_worker.py and its arguments) forked from the node's server."""
    try:
        conn, pid = _ask(argv)
    except Exception as exc:  # the worker starts as Ray would have started it
        print(f"petatrain fork server: not used ({exc}); the worker starts on its own", file=sys.stderr)
        os.execv(sys.executable, [sys.executable, *argv])

    def forward(signum: int, _frame: object) -> None:
        # To the worker's process group, as the raylet signals its workers' (a worker already ended: no-op).
        with contextlib.suppress(OSError):
            os.killpg(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    os._exit(_wait(conn, pid))


def _ask(argv: list[str]) -> tuple[socket.socket, int]:
    path = socket_path(argv, dict(os.environ))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        _start_server(path)
        deadline = time.monotonic() + CONNECT_WAIT_S
        while True:
            time.sleep(0.02)
            try:
                conn.connect(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "shim": os.getpid()}).encode()
    conn.sendall(len(request).to_bytes(8, "big"))
    sent = conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    conn.sendall(request[sent:])
    conn.settimeout(ANSWER_WAIT_S)
    answer = _line(conn)
    if not answer.isdigit():
        raise OSError(answer or "the server closed the connection")
    conn.settimeout(None)
    return conn, int(answer)


def _wait(conn: socket.socket, pid: int) -> int:
    """The forked worker's exit status, from the server; if the server is gone, wait for the worker itself."""
    status = _line(conn)
    if status.lstrip("-").isdigit():
        return _exit_code(int(status))
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return 1
    select.select([fd], [], [])
    return 1


def _exit_code(status: int) -> int:
    """A worker killed by signal N exits the shim with 128 + N, as a shell reports it."""
    return status if status >= 0 else 128 - status


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def socket_path(argv: list[str], env: dict[str, str]) -> str:
    """The server's socket: beside the raylet's, one per environment (a digest of all its variables, the
    Ray job's ID among them: modules imported by the server read some once, RAY_JOB_ID included)."""
    raylet = next((a.split("=", 1)[1] for a in argv if a.startswith("--raylet-name=")), "")
    if not raylet:
        raise OSError("no --raylet-name in the worker's arguments")
    # The raylet's socket too: two nodes on one machine (in two network namespaces) never share a server.
    digest = hashlib.sha256(json.dumps([sys.executable, raylet, sorted(env.items())]).encode()).hexdigest()[:12]
    path = os.path.join(os.path.dirname(raylet), f"petatrain-fork-{digest}")
    if len(path.encode()) > _MAX_SOCKET_PATH:
        raise OSError(f"socket path too long ({len(path)} bytes)")
    return path


def _start_server(path: str) -> None:
    """Start the server in a session of its own (double fork), its output in the session's logs."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        logs = os.path.join(os.path.dirname(os.path.dirname(path)), "logs")
        log_file = os.path.join(logs, os.path.basename(path) + ".log")
        log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.execv(sys.executable, [sys.executable, "-c", SERVER_CODE, path])
    finally:
        os._exit(1)


# --- the server ------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import a rank's modules once, then fork a worker process for each shim that asks."""
    import fcntl

    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another shim's server won the race
    raylet = int(os.environ.get("RAY_RAYLET_PID", "0") or 0)
    with contextlib.suppress(OSError):
        os.unlink(path)  # a server that was killed left it
    old = os.umask(0o177)
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)  # before the imports: shims connect at once and wait for their answer
    finally:
        os.umask(old)
    server.listen(128)
    try:
        worker = _import_all()
        os.chdir("/")  # the first shim's directory may go; each child takes its own
        _loop(server, lock, worker, raylet)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _import_all() -> str:
    """Import what a rank imports; returns the path of Ray's worker script, the only one served."""
    import importlib

    started, cpu = time.time(), time.process_time()
    from petatrain.runtime._ray import class_ids_from_os, default_worker_script
    from petatrain.runtime.startup.spares import MODULES

    with class_ids_from_os():
        for name in MODULES:
            importlib.import_module(name)
        worker = default_worker_script()
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA
        raise RuntimeError("CUDA was initialised while importing; not forking from this process")
    _check_ids_differ()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} imported in {time.time() - started:.1f} s "
        f"({time.process_time() - cpu:.1f} s of CPU); serving {worker}",
        flush=True,
    )
    return worker


def _check_ids_differ() -> None:
    """Fork two probes that draw one of Ray's random IDs each: equal IDs mean the imports seeded Ray's
    generator (`_ray.class_ids_from_os` missed a draw), and forked workers would repeat each other's IDs."""
    from petatrain.runtime._ray import random_id

    drawn = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, random_id())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        drawn.append(os.read(read, 64))
        os.close(read)
    if drawn[0] == drawn[1]:
        raise RuntimeError("Ray's random IDs were seeded while importing: forked workers would repeat them")


def _loop(server: socket.socket, lock: int, worker: str, raylet: int) -> None:
    children: dict[int, socket.socket] = {}
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([server], [], [], 0.5)
        _reap(children)
        if raylet and not _alive(raylet):
            return
        if not ready:
            if not children and time.monotonic() - last > IDLE_EXIT_S:
                return
            continue
        last = time.monotonic()
        conn, _ = server.accept()
        try:
            request, fds = _read_request(conn)
        except Exception as exc:  # a malformed request: refused, the server goes on
            _refuse(conn, f"bad request: {exc}")
            continue
        try:
            if os.path.realpath(request["argv"][0]) != worker:
                _refuse(conn, f"not Ray's worker script: {request['argv'][0]}")
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, fds, [server.fileno(), lock, conn.fileno(), *(c.fileno() for c in children.values())])
            with contextlib.suppress(OSError):  # a shim gone meanwhile: its worker registers with no one and exits
                conn.sendall(b"%d\n" % pid)
            children[pid] = conn
        finally:
            for fd in fds:
                os.close(fd)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(10.0)
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    if int.from_bytes(creds[4:8], sys.byteorder) != os.getuid():
        raise PermissionError("another user's process")
    size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
    if not 0 < size < 1 << 24:
        raise ValueError(f"size {size}")
    fds = array.array("i")
    data, ancillary, _flags, _addr = conn.recvmsg(size, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    try:
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise ValueError("truncated")
            data += chunk
        if len(received) != 3:
            raise ValueError(f"{len(received)} file descriptors, not 3")
        conn.settimeout(None)
        request = json.loads(data)
        argv, env, cwd, shim = request["argv"], request["env"], request["cwd"], request["shim"]
        if not (argv and all(isinstance(a, str) for a in argv) and isinstance(cwd, str) and isinstance(shim, int)):
            raise ValueError("argv must be strings, cwd a string, shim a process ID")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env must map strings to strings")
        return request, received
    except Exception:
        for fd in received:
            os.close(fd)
        raise


def _refuse(conn: socket.socket, why: str) -> None:
    print(f"refused: {why}", flush=True)
    with contextlib.suppress(OSError):
        conn.sendall(why.replace("\n", " ").encode()[:200] + b"\n")
    conn.close()


def _child(request: dict, fds: list[int], close: list[int]) -> None:
    """The forked worker: the shim's stdio, directory and environment, then Ray's worker as __main__."""
    code = 1
    try:
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.setsid()
        _die_with(request["shim"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        np_random = sys.modules.get("numpy.random")
        if np_random is not None:
            np_random.seed()  # the server's global state would repeat in every child
        argv = request["argv"]
        sys.argv = list(argv)
        here = os.path.dirname(argv[0])  # as Python puts a script's directory first (the server's is -c's "")
        sys.path[0:1] = [here] if sys.path and sys.path[0] == "" else [here, *sys.path[:1]]
        import runpy

        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _die_with(shim: int) -> None:
    """End this worker's process group when its shim ends.

    The raylet started the shim as its worker, in a process group of its own, and ends a worker
    by signalling that group: SIGTERM, then SIGKILL (a rank answers SIGTERM by draining, not
    exiting). The shim forwards SIGTERM to this group; a SIGKILL it cannot forward, so a thread
    here waits for the shim's end and kills the group, as the raylet's SIGKILL would have.
    """
    import threading

    def watch() -> None:
        try:
            select.select([os.pidfd_open(shim)], [], [])
        finally:
            os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="petatrain-shim-watch", daemon=True).start()


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
            conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


if __name__ == "__main__":
    shim(sys.argv[1:])
