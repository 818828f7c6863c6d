"""Start or join the Ray cluster, and what the driver asks it about: alive nodes, leftovers, processes."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from petatrain import constants
from petatrain.errors import PetatrainError

if TYPE_CHECKING:
    from petatrain.config import RayTlsConfig

log = logging.getLogger(__name__)

CLIENT_SERVER_RETRIES = 2  # new connections when a Ray Client server fails to start this driver's server


def init_ray(address: str, local_cpus: int = 0, tls: RayTlsConfig | None = None) -> None:
    """Connect to `address` ("": RAY_ADDRESS's cluster if it is set, as `ray.init()` does), or start a
    local Ray; reuse one this process already started. With `tls`, Ray's TLS is on (the cluster joined
    must run with certificates of the same CA)."""
    if tls is not None:  # before Ray's core library loads: it reads them once
        from petatrain.runtime.tls import enable

        enable(tls)
    import ray

    from petatrain.runtime._ray import local_only_cluster, silence_worker_logs

    if ray.is_initialized():
        return
    # A scheduler's task or a Ray job's entrypoint finds its cluster there: joined, not a local Ray started
    # beside it (and its token checked at once, not after ray.init's 20 s of retries).
    address = joined(address)
    _check_token(os.environ.get(constants.RAY_ADDRESS_ENV, "") if address == "auto" else address)
    kwargs: dict[str, Any] = {"num_cpus": local_cpus} if local_cpus and not address else {}
    local: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if not address:
        constants.set_local_cluster_defaults()
        kwargs["_node_ip_address"] = "127.0.0.1"  # listen on loopback only (see local_only_cluster)
        local = local_only_cluster()
    elif address.rpartition(":")[0] in ("127.0.0.1", "localhost"):
        local = local_only_cluster()  # else ray.init swaps 127.0.0.1 for this machine's address: unreachable
    from petatrain.console import ray_output_to_console

    to_console = ray_output_to_console()  # --verbose, PETATRAIN_DEBUG=1; else it stays in Ray's logs
    for tries_left in range(CLIENT_SERVER_RETRIES, -1, -1):
        try:
            with local:
                ray.init(
                    address=address or None,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    log_to_driver=to_console,
                    **kwargs,
                )
            break
        except ConnectionError as exc:
            # The Ray Client server starts a server process per driver; forked while its other
            # threads are inside gRPC, that process sometimes dies at once (the server's log: "Other
            # threads are currently calling into gRPC, skipping fork() handlers"; 3 connections in 12
            # to a 2-core head, each after a 30 s wait). A head started with GRPC_ENABLE_FORK_SUPPORT=0
            # never does (14 in 14; `deploy k8s` sets it); else a new connection gets a new process.
            said = str(exc)
            died = "Starting Ray client server failed" in said or "start_specific_server" in said
            if tries_left and is_client_address(address) and died:
                log.info("the Ray Client server at %s could not start this driver's server; trying again", address)
                continue
            raise PetatrainError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
    if not to_console:
        silence_worker_logs()
    # Before Ray's own exit hook (registered when Ray is imported; atexit runs last-in first), once.
    atexit.unregister(_end_local_monitor)
    atexit.register(_end_local_monitor)


def stop_ray() -> None:
    """`ray.shutdown()`, a second sooner where this process started the local Ray (see
    `_ray.end_local_monitor`); a process that exits without it gets the same at exit."""
    import ray

    _end_local_monitor()
    ray.shutdown()


def _end_local_monitor() -> None:
    from petatrain.runtime._ray import end_local_monitor

    try:
        end_local_monitor()
    except Exception:  # an optimisation: Ray's shutdown stops it the slow way
        log.debug("could not end the local Ray's monitor first", exc_info=True)


def joined(address: str) -> str:
    """The cluster a driver given `address` joins: `address`, else RAY_ADDRESS's (as `ray.init()`
    reads it); "" where it starts a local Ray."""
    return address or os.environ.get(constants.RAY_ADDRESS_ENV, "")


def is_client_address(address: str) -> bool:
    """A Ray Client address (`ray://host:port`): this process would drive the cluster from outside it."""
    return joined(address).startswith("ray://")


def _check_token(address: str) -> None:
    """One line, at once, for a cluster that refuses this process's token (see _ray.token_refused)."""
    from petatrain.runtime._ray import token_refused

    if not address or address == "auto" or not token_refused(address):
        return
    mode = os.environ.get(constants.RAY_AUTH_MODE_ENV, "").lower()
    token = f"{constants.RAY_AUTH_TOKEN_ENV} (or RAY_AUTH_TOKEN_PATH, default ~/.ray/auth_token) to the cluster's token"
    if mode != "token":
        raise PetatrainError(
            f"the Ray cluster at {address} requires token authentication and this process sends no token: "
            f"set {constants.RAY_AUTH_MODE_ENV}=token and {token}"
        )
    raise PetatrainError(
        f"the Ray cluster at {address} refused this process's token ({constants.RAY_AUTH_MODE_ENV}=token): set {token}"
    )


class RayCluster:
    """The supervisor's view of the cluster (runtime.supervisor.Cluster)."""

    def resources(self) -> tuple[float, float]:
        """Totals of the alive nodes' CPUs and GPUs."""
        import ray

        totals = ray.cluster_resources()
        return totals.get("CPU", 0), totals.get("GPU", 0)

    def alive_nodes(self) -> set[str]:
        return alive_nodes()


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def remove_leftover_placement_groups(only: Collection[str] | None = None) -> None:
    """Remove this job's placement groups a failed attempt left behind (its controller died
    before releasing them), so the next attempt's workers can be scheduled. `only`: just these
    (a run that shares its Ray job with others, a search's trial, removes its own alone)."""
    import ray
    from ray.util.placement_group import placement_group_table

    job = ray.get_runtime_context().get_job_id()
    leftovers = [pg_id for pg_id in placement_group_table() if pg_id.endswith(job)] if only is None else only
    remove_placement_groups(leftovers, "left by the failed attempt")


def remove_placement_groups(ids: Iterable[str], why: str) -> None:
    """Remove the placement groups `ids` that still hold or wait for resources (any job's)."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    table = placement_group_table()
    for pg_id in sorted(set(ids)):
        if table.get(pg_id, {}).get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
            log.warning("removing placement group %s %s", pg_id, why)
            with contextlib.suppress(Exception):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def kill_pids(where: list[tuple[str, int]], timeout_s: float = 10.0) -> None:
    """Kill each (node id, pid), through a task on its node; returns once done or after `timeout_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    refs = [
        ray.remote(num_cpus=0)(kill_pid)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote(pid)
        for node, pid in where
    ]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def kill_pid(pid: int) -> None:
    """Dump the stuck worker's stacks to its log (faulthandler on SIGUSR1), then kill it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.1)  # faulthandler writes from its C signal handler, at once (a stopped process: on SIGKILL, never)
        os.kill(pid, signal.SIGKILL)


def died_on_its_own(where: dict[tuple[int, str], int], wait_s: float = 2.0) -> int | None:
    """Of the ranks at (pid, node id), the one whose actor died of its process's exit (a system
    error), not of a `ray.kill`; GCS may learn of the death a moment later, hence `wait_s`."""
    import ray

    from petatrain.runtime._ray import dead_actors

    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            dead = dead_actors(job)
        except Exception:  # without GCS's answer the error's own cause stands
            return None
        for actor in dead:
            pid, node = actor.get("Pid"), actor.get("Address", {}).get("NodeID")
            rank = where.get((pid, node)) if pid is not None and node is not None else None
            if rank is not None and "worker process has died" in str(actor.get("DeathCause", "")):
                return rank
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)
