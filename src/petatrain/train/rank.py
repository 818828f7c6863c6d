"""What the worker loop needs from the process that runs it, as Protocols.

`train/loop.py` is given a `RankEnv` and never learns who built it: `runtime.worker.RankEnv.from_ray`
builds one inside a Ray Train worker (its channel is the run hub actor), tests may build one by hand.
The loop's own endings that the supervisor must know by type, `Preempted` and `Resized`, are defined
here too, so that the runtime imports them from training and not the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

from petatrain.errors import PetatrainError
from petatrain.observe.events import Event


class Preempted(PetatrainError):
    """Raised after a preemption notice once the checkpoint of the current step is committed."""


class Resized(PetatrainError):
    """Raised when the driver asked for more workers (the cluster grew back within `parallel.workers`),
    once the checkpoint of the current step is committed: the next attempt runs on more ranks."""


class Telemetry(Protocol):
    """Events and step heartbeats on their way to the run's ledger and watchdog."""

    period_s: float
    attempt: int

    def record(self, event: Event) -> None: ...
    def progress(self, step: int, *, now: bool = False) -> None: ...
    def commit(self, info: dict[str, Any]) -> None: ...
    def alive(self) -> None: ...
    def flush(self, wait: bool = False) -> None: ...
    def hold(self, step: int) -> None:
        """Return once the evaluation of `step` was taken (Payload.hold_at_eval)."""
        ...

    def resize_requested(self) -> int | None:
        """The worker count the driver asked this attempt to restart on, once its answer is in (else None)."""
        ...

    def stop_requested(self) -> bool:
        """Whether the driver asked the run to end (TrainJob.stop), once its answer is in."""
        ...


class HubChannel(Protocol):
    """One rank's calls to the driver: events, heartbeats, checkpoint parts, injected faults."""

    attempt: int

    def emit(self, event: Event, sync: bool = False) -> None: ...
    def beat(self, step: int) -> None: ...
    def telemetry(self, period_s: float = 1.0) -> Telemetry: ...
    def report_part(self, step: int, rank: int, files: Any) -> Any: ...
    def wait_parts(self, step: int, world: int, timeout_s: float) -> Any: ...
    def fired_keys(self) -> set[str]: ...
    def fire(self, key: str, fields: dict[str, Any]) -> bool: ...


class PreemptionNotice(Protocol):
    """A SIGTERM turned into a flag the loop reads at the step boundary."""

    @property
    def received(self) -> bool: ...
    def wait(self, timeout_s: float) -> bool: ...


class NextRanks(Protocol):
    """Told once this rank trains, so the next attempt's processes can start meanwhile."""

    def trained(self) -> None: ...


class RankEnv(Protocol):
    """Who this rank is and its channels to the driver."""

    rank: int
    world: int
    node_id: str
    placement_group: str

    @property
    def hub(self) -> HubChannel: ...
    def device(self, accelerator: str) -> Any: ...
    def next_ranks(self, cfg: Any) -> NextRanks: ...
    def warm_up(self) -> dict | None: ...
    def preemption_notice(self) -> PreemptionNotice: ...
