"""Start or join the Ray cluster, and what the driver asks it about: alive nodes, leftovers, processes."""

from __future__ import annotations

import contextlib
import logging

from petatrain.errors import PetatrainError
from petatrain.runtime import constants

log = logging.getLogger(__name__)


def init_ray(address: str, local_cpus: int = 0) -> None:
    """Connect to `address`, or start a local Ray; reuse one this process already started."""
    import ray

    from petatrain.runtime._ray import local_only_cluster

    if ray.is_initialized():
        return
    kwargs = {"num_cpus": local_cpus} if local_cpus and not address else {}
    local = contextlib.nullcontext()
    if not address:
        constants.set_local_cluster_defaults()
        kwargs["_node_ip_address"] = "127.0.0.1"  # listen on loopback only (see local_only_cluster)
        local = local_only_cluster()
    try:
        with local:
            ray.init(address=address or None, include_dashboard=False, logging_level=logging.WARNING, **kwargs)
    except ConnectionError as exc:
        raise PetatrainError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
