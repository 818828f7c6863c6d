"""The one corner of petatrain that touches Ray's private modules (`ray._private`, `ray._raylet`,
`ray.train.v2._internal`). Every name used here is checked by tests/test_ray_internals.py, which
fails naming the attribute when a Ray upgrade moves it.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def local_only_cluster() -> Iterator[None]:
    """While Ray starts: bind everything to loopback.

    Ray binds the GCS, the raylet, every worker's gRPC server, the runtime-env and dashboard agents
    and the autoscaler's metrics to 127.0.0.1 when that is the node's IP, but ray.init swaps
    127.0.0.1 for this machine's address unless Ray runs local-only, as on macOS
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when ray is imported: hence the constant).
    """
    from ray._private import ray_constants

    clusters = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters


def replace_sigterm_exit(handler: Callable[..., None]) -> bool:
    """Make a Ray worker's SIGTERM call `handler` instead of exiting; False outside a Ray worker.

    Ray worker processes install a SIGTERM handler on their main thread that exits the process;
    the training function runs on another thread, where `signal.signal` is not allowed. The
    handler calls `ray._private.worker.raise_sys_exit_with_custom_error_message` by global name,
    so replacing that name turns the exit into whatever `handler` does.
    """
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return False
    if not hasattr(ray_worker, "raise_sys_exit_with_custom_error_message"):
        return False
    ray_worker.raise_sys_exit_with_custom_error_message = handler
    return True


def dead_actors(job_id_hex: str) -> list[dict]:
    """GCS's table of this job's dead actors (Pid, Address.NodeID, DeathCause)."""
    import ray
    import ray._private.state as ray_state

    job = ray.JobID.from_hex(job_id_hex)
    return list(ray_state.actors(job_id=job, actor_state_name="DEAD").values())


def silence_worker_logs() -> None:
    """Keep the raylet's notices (a worker killed on purpose) off the driver's console; they
    print apart from `log_to_driver` and stay in the session's log files."""
    import ray._private.worker as ray_worker

    ray_worker._worker_logs_enabled = False


def end_local_monitor() -> None:
    """End the autoscaler monitor of the local Ray this process started, before Ray stops the rest.

    `ray.shutdown` stops the raylet, then the GCS, then the monitor with SIGTERM and one second to
    exit. The monitor's SIGTERM handler reports its end to the GCS, gone by then, and waits on it
    until Ray kills it: 1.0 of the 1.5 s every local Ray's stop took. A one-node cluster's monitor
    keeps nothing, so it is killed first; the GCS never hears of it. Nothing where this process
    joined a cluster."""
    import ray._private.worker as ray_worker
    from ray._private import ray_constants

    node = ray_worker._global_node
    if node is None or not node.head:
        return
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                info.process.wait(timeout=1)


def session_dir() -> str:
    """This node's Ray session folder (/tmp/ray/session_...)."""
    import ray._private.worker as ray_worker

    return ray_worker.global_worker.node.get_session_dir_path()


def prestart_workers(count: int, runtime_env: str, keep_alive_s: int) -> None:
    """Ask this node's raylet to start `count` idle worker processes of this job and runtime environment."""
    import ray
    import ray._private.worker as ray_worker
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    node = ray_worker.global_worker.node
    request = node_manager_pb2.PrestartWorkersRequest(
        language=common_pb2.PYTHON,
        job_id=bytes.fromhex(ray.get_runtime_context().get_job_id()),
        num_workers=count,
        keep_alive_duration_secs=keep_alive_s,
    )
    request.runtime_env_info.serialized_runtime_env = runtime_env
    channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


def default_worker_script() -> str:
    """The real path of Ray's worker script (`ray._private.workers.default_worker`), imported: the fork
    server imports it once and runs it as `__main__` in each process it forks."""
    import os

    from ray._private.workers import default_worker

    return os.path.realpath(default_worker.__file__ or "")


@contextlib.contextmanager
def class_ids_from_os() -> Iterator[None]:
    """While a fork server imports: the IDs `@ray.remote` classes draw at import come from the OS.

    Ray's core library draws every random ID from one generator per process, seeded at its first
    use and never again ("not fork-safe", src/ray/util/util.h); `ray.actor` draws an actor class's
    ID (`ActorClassID.from_random()`) when the class is decorated. Drawn in the server, it would
    seed the generator there, and every forked worker would then draw the same task IDs.
    """
    import os

    import ray.actor

    real = ray.actor.ActorClassID

    class FromOs:
        @staticmethod
        def from_random() -> object:
            return real(os.urandom(real.size()))

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    ray.actor.ActorClassID = FromOs()
    try:
        yield
    finally:
        ray.actor.ActorClassID = real


def random_id() -> bytes:
    """A random ID from Ray's core library (its per-process generator; see class_ids_from_os)."""
    from ray._raylet import UniqueID

    return UniqueID.from_random().binary()


def token_refused(address: str, timeout_s: float = 10.0) -> bool:
    """Whether the cluster at `address` (a GCS `host:port`, or a Ray Client `ray://host:port`)
    refuses this process's token authentication: it asks for a token and this process sends none,
    or another one. One RPC through the channel Ray's own clients build (the token when
    RAY_AUTH_MODE=token, RAY_USE_TLS's certificates), instead of ray.init's retries: those log a
    line per second for 20 s and end in a "Failed to connect" that does not say why. False when
    the cluster answers, or fails in any other way (ray.init then reports that itself)."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc

    client = address.startswith("ray://")
    target = address[len("ray://") :].split("/", 1)[0] if client else address
    try:
        channel = init_grpc_channel(target)
    except Exception:  # no token file where RAY_AUTH_MODE=token says there is one, bad certificates: Ray's to say
        return False
    try:
        if client:
            ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout_s)
        else:
            request = gcs_service_pb2.GetClusterIdRequest()
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAUTHENTICATED
    except Exception:
        return False
    finally:
        channel.close()
    return False
