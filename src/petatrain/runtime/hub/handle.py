"""The driver's side of the run hub: starting the actor, calling it, closing it."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from petatrain.config import JobConfig
from petatrain.runtime import cluster
from petatrain.storage import StorageOptions

log = logging.getLogger(__name__)


class HubHandle:
    """The driver's side of the run hub actor."""

    def __init__(self, actor: Any):
        self.actor = actor

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def close(self) -> None:
        import ray

        try:
            self.call("close")
            ray.kill(self.actor)
        except Exception:  # the ledger was flushed on every event; closing is best effort
            log.debug("hub close failed", exc_info=True)


def start(
    run_url: str, run_id: str, cfg: JobConfig, options: StorageOptions, fired: list[str], hold_until_a_step: bool
) -> HubHandle:
    """The run hub, on the driver's node: its metrics endpoint is on this machine's 127.0.0.1.
    `options`: as Ray processes get them. `fired`: injected faults that fired under an earlier driver
    of the run (none fires again). `hold_until_a_step`: the ledger is held until the run trains a step
    (a finished run's continuation)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from petatrain.runtime.hub.actor import RunHub

    # mypy keeps a decorated class's own type: it cannot see that @ray.remote made RunHub an actor class.
    actor = RunHub.options(  # type: ignore[attr-defined]
        # Unique per driver: a lost driver's hub may still be going away when the next one starts.
        name=f"petatrain-hub-{run_id}-{uuid.uuid4().hex[:6]}",
        scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.this_node(), soft=False),
    ).remote(run_url, options, cfg.observe.metrics_host, cfg.observe.metrics_port, fired, hold_until_a_step)
    return HubHandle(actor)
