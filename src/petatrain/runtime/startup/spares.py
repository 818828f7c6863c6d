"""Spare worker processes: the next attempt's ranks, started and imported while this one trains.

Ray Train starts new worker actors for every attempt, and on 2 cores each new rank spent
~3.4 s of CPU before it could build a model: starting Python and Ray, importing torch
(~1.0 s), Ray Train (~0.8 s) and petatrain. A restart waits for all of it.

Ray places a new actor in an idle worker process of its node if that process has the
actor's runtime environment and has never run anything (a process that ran a task is not
reused for an actor), and the raylet's `PrestartWorkers` call starts such processes. So:

- the worker group's runtime environment carries a setup hook, `warm_up`, that Ray runs in
  every new worker process of the group before it takes work: it imports what a rank
  imports (`worker_runtime_env`);
- once an attempt has taken its first step, each node's local rank 0 asks its raylet for
  as many spares as the node runs ranks, with its own runtime environment (`top_up`); the
  next attempt's actors start in them and skip the imports.

A spare must not slow the ranks it stands behind. While ranks train on its node (each
holds a shared lock, `hold_training_lock`), a spare imports at `SCHED_IDLE` and takes only
the CPU the ranks leave; when nothing trains (a restart is under way and may be waiting
for this very process) it imports at normal priority. Once imported, it waits with all its
threads at SCHED_IDLE while ranks train (an idle Ray worker still spends ~0.85% of a core)
and at normal priority while none do. Going back to the normal policy needs CAP_SYS_NICE or
RLIMIT_NICE; without them a spare stays at normal priority throughout. Each spare registers
itself in the Ray session directory, under its job and runtime environment, until a rank
starts in it (`claim`), so a node never holds more than it needs. Spares belong to the
run's Ray job, and Ray ends them with it.

Everything here is an optimisation: if Ray's internals move, or a call fails, ranks start
cold as they did before, and the hook never raises into Ray's worker start-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import math
import os
import sys
import threading
import time
from typing import Any

from petatrain import constants

log = logging.getLogger(__name__)

HOOK_ENV = constants.WORKER_SETUP_HOOK_ENV  # a module path in it: imported and called by every new worker process
HOOK = "petatrain.runtime.startup.spares.warm_up"
# What a rank imports before its first step, heaviest first.
MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # DDP's and FSDP's constructors import it: 1.5-2 s of CPU per rank
    "ray.train.torch",
    "ray.train.v2._internal.execution.worker_group.worker",
    "petatrain.train.loop",
    "ray._private.grpc_utils",  # top_up's: its call then takes milliseconds on the step's path
    "petatrain.runtime._ray",
    "ray.core.generated.node_manager_pb2_grpc",
)
KEEP_ALIVE_S = 3600  # the raylet keeps an idle spare at least this long (Spares.TOP_UP_EVERY_S replaces it after)
_REGISTRY = "petatrain-spares"
_TRAINING_LOCK = "petatrain-training.lock"
_held: list[int] = []  # the training lock's descriptor, held until the rank's process ends
_warmed: dict = {}  # this process's warm-up: started, ready, idle
_claimed = threading.Event()  # a rank has started in this process
_flip = threading.Lock()  # one priority change at a time: a waiting spare's follower, or claim()


def worker_runtime_env(cpus_per_worker: float, *, hook: bool = True) -> dict:
    """The worker group's runtime environment: every new worker process of the group runs `warm_up`
    (without `hook`, only the threads below).

    It also fixes OMP_NUM_THREADS from the start, to what Ray would set it to when the rank's
    actor starts (the floor of its CPUs, at least 1) unless the driver's environment sets it.
    Ray sets it only then, and torch, imported earlier by `warm_up` or by the fork server,
    would have sized its thread pool by the node's cores: the ranks of a node would
    oversubscribe its cores.
    """
    threads = os.environ.get(constants.OMP_THREADS_ENV) or str(max(1, math.floor(cpus_per_worker)))
    return {"env_vars": {constants.OMP_THREADS_ENV: threads} | ({HOOK_ENV: HOOK} if hook else {})}


def wanted(cfg: Any) -> bool:
    """Whether a job's attempts get spares: `faults.spares`, and restarts allowed at all."""
    return cfg.faults.spares and cfg.faults.max_restarts > 0


class Spares:
    """A rank's side: it is no longer a spare; once it trains, the node gets spares for the next attempt."""

    TOP_UP_EVERY_S = 600.0  # spares the raylet ended (KEEP_ALIVE_S) are replaced this often

    def __init__(self, local_rank: int, local_world: int, *, enabled: bool):
        claim()
        self.local_rank, self.local_world, self.enabled = local_rank, local_world, enabled
        self._next = 0.0  # monotonic time of the next top-up; the first step does one

    def trained(self) -> None:
        """After every step; does something after the first and then every TOP_UP_EVERY_S."""
        if not self.enabled or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.TOP_UP_EVERY_S
        hold_training_lock()
        if self.local_rank == 0:  # synchronous: the raylet has the request even if this rank hangs next
            top_up(self.local_world)


def warm_up() -> None:
    """Ray's setup hook for the group's worker processes: import what a rank needs, quietly if ranks train here."""
    try:
        started, cpu_before = time.time(), time.process_time()  # the process's CPU so far: Python and Ray start-up
        _register({"started": started})
        idle_ok, idle_used = _can_leave_idle(), False
        for name in MODULES:
            idle = idle_ok and _training_here()
            idle_used |= idle
            with _priority(idle=idle):
                importlib.import_module(name)
        cpu = {"cpu_start_s": round(cpu_before, 3), "cpu_imports_s": round(time.process_time() - cpu_before, 3)}
        _warmed.update(started=started, ready=time.time(), idle=idle_used, **cpu)
        _register(_warmed)
        if idle_ok:
            threading.Thread(target=_follow_training, name="petatrain-spare-priority", daemon=True).start()
    except Exception:  # a failing hook would stop Ray's worker start-up; the rank imports again anyway
        log.warning("spare warm-up failed; the rank imports on its own", exc_info=True)


def warmed() -> dict | None:
    """This process's warm-up (started, ready: unix times; idle; CPU seconds), None if it did not run.

    Started before the rank's attempt began: the rank started in a spare.
    """
    return dict(_warmed) or None


def claim() -> None:
    """A rank has started in this process: it is no longer a spare (normal priority, off the registry)."""
    _claimed.set()
    if _warmed:
        with _flip, contextlib.suppress(OSError):
            _normal_policy()
    with contextlib.suppress(Exception):
        os.unlink(os.path.join(_registry_dir(), f"{_group()}-{os.getpid()}"))


def _follow_training(period_s: float = 0.1) -> None:
    """A waiting spare: every thread at SCHED_IDLE while ranks train on the node, normal otherwise.

    An idle Ray worker still spends ~0.85% of a core (its loops), which two busy cores take
    from the steps; at SCHED_IDLE it takes only what the ranks leave. When the lock is free an
    attempt has ended and the next one may start its ranks here: normal priority at once
    (within `period_s`). Ends when a rank starts in the process (`claim`).
    """
    idle = False
    while not _claimed.wait(period_s):
        training = _training_here()
        if training == idle:
            continue
        with _flip:
            if _claimed.is_set():
                return
            with contextlib.suppress(OSError):
                if training:
                    _set_policy(os.SCHED_IDLE)
                else:
                    _normal_policy()
            idle = training


def hold_training_lock() -> None:
    """Mark this node as training for as long as this process lives (spares then import at idle priority)."""
    if _held:
        return
    with contextlib.suppress(Exception):
        fd = os.open(os.path.join(_session_dir(), _TRAINING_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held.append(fd)


def top_up(count: int, keep_alive_s: int = KEEP_ALIVE_S) -> int:
    """Ask this node's raylet for spares until `count` of this group live here; returns how many it asked for."""
    try:
        import ray

        from petatrain.runtime._ray import prestart_workers

        runtime_env = ray.get_runtime_context().get_runtime_env_string()
        if HOOK_ENV not in runtime_env:
            return 0  # this group's processes would not warm up: a spare saves little
        want = count - live_spares()
        if want <= 0:
            return 0
        prestart_workers(want, runtime_env, keep_alive_s)
        return want
    except Exception as exc:  # ranks start cold, as without spares
        log.warning("could not start spare worker processes (%s); the next attempt's ranks start cold", exc)
        return 0


def live_spares() -> int:
    """Spares of this group on this node: started, alive, and no rank in them yet."""
    return sum(1 for _ in _entries())


def spares_here() -> list[dict]:
    """This group's spares on this node, as they registered: pid, started, and once imported ready and idle."""
    found = []
    for pid, path in _entries():
        with contextlib.suppress(FileNotFoundError, ValueError), open(path) as f:
            found.append({"pid": pid, **json.loads(f.read())})
    return found


def _entries():
    """(pid, path) of this group's live spares in the registry; entries of dead processes are removed."""
    directory, group = _registry_dir(), _group()
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(directory)):
            owner, _, pid = name.rpartition("-")
            if owner != group or not pid.isdigit():  # dot names (being written) have another owner
                continue
            path = os.path.join(directory, name)
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            except PermissionError:
                pass  # alive, another user's
            yield int(pid), path


def _register(state: dict) -> None:
    directory = _registry_dir()
    os.makedirs(directory, exist_ok=True)
    name = f"{_group()}-{os.getpid()}"
    with open(os.path.join(directory, f".{name}"), "w") as f:  # readers skip dot names
        f.write(json.dumps(state))
    os.replace(os.path.join(directory, f".{name}"), os.path.join(directory, name))


def _training_here() -> bool:
    """True while a rank on this node holds the shared training lock.

    The probe takes the lock exclusively for a moment, so two spares probing at once can
    see each other as a rank: the loser then reads "training" for one probe (one import, or
    0.1 s of waiting at idle priority).
    """
    try:
        fd = os.open(os.path.join(_session_dir(), _TRAINING_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also releases the probe's lock


@contextlib.contextmanager
def _priority(*, idle: bool):
    """Run the body at SCHED_IDLE (this thread only), then put every thread of the process back."""
    if not idle:
        yield
        return
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield
    finally:
        _normal_policy()


def _set_policy(policy: int) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def _normal_policy() -> None:
    """Threads started during an idle import inherit SCHED_IDLE: return them all to the normal policy."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def _can_leave_idle() -> bool:
    """Whether a thread may go from SCHED_IDLE back to normal here (tried on a throwaway thread)."""
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="petatrain-sched-probe")
    thread.start()
    thread.join()
    return bool(result and result[0])


def _session_dir() -> str:
    from petatrain.runtime._ray import session_dir

    return session_dir()


def _registry_dir() -> str:
    return os.path.join(_session_dir(), _REGISTRY)


def _job() -> str:
    import ray

    return ray.get_runtime_context().get_job_id()


def _group() -> str:
    """Job and runtime environment: only a spare of both can take a rank (the registry's key).

    Ray passes every worker process its runtime environment's hash (`--runtime-env-hash`),
    the same in a spare and in the rank that asks for more.
    """
    env_hash, argv = "0", sys.argv
    for i, arg in enumerate(argv):
        if arg.startswith("--runtime-env-hash="):
            env_hash = arg.split("=", 1)[1]
        elif arg == "--runtime-env-hash" and i + 1 < len(argv):
            env_hash = argv[i + 1]
    return f"{_job()}-{env_hash}"
