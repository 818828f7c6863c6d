"""The supervisor's attempts on Ray (runtime.supervisor.Attempts): the standby, the watchdog, the TorchTrainer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from petatrain.config import JobConfig
from petatrain.observe import events as ev
from petatrain.runtime import cluster
from petatrain.runtime.failures import CAUSES, AttemptFailed, FailureCause
from petatrain.runtime.hub.handle import HubHandle
from petatrain.runtime.job import TrainJob
from petatrain.runtime.startup.standby import Standby
from petatrain.runtime.supervisor import AttemptOutcome
from petatrain.runtime.trainer import fit, make_trainer
from petatrain.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


class RayAttempts:
    """Runs each attempt on Ray Train, and writes the driver's events through the hub."""

    def __init__(
        self,
        job: TrainJob,
        cfg: JobConfig,
        run_url: str,
        run_id: str,
        hub: HubHandle,
        grow: Callable[[int], int | None] | None = None,
    ):
        self.job, self.cfg, self.run_url, self.run_id, self.hub = job, cfg, run_url, run_id, hub
        self.started = time.time()
        self.carry_step: int | None = None  # setup.Run.carry_step
        self.ended = False  # the ledger has the run's end (finished or given up)
        address = job.address or cfg.resources.address
        self.local = not cluster.joined(address)
        self.client = cluster.is_client_address(address)  # Ray Client: this process is off the cluster
        self.standby = Standby(self.build, enabled=cfg.faults.standby)
        most = cfg.parallel.worker_range()[1]
        timeout_s = cfg.faults.hang_timeout_s
        self.watch = Watchdog(hub.actor, timeout_s, on_training=self.standby.prepare, grow=grow, most=most)
        from petatrain.train.loop import NonFiniteLoss

        self.causes = {**CAUSES, NonFiniteLoss: FailureCause.NONFINITE}
        self._closed = threading.Event()
        if job.stop is not None:
            threading.Thread(target=self._forward_stop, args=(job.stop,), name="petatrain-stop", daemon=True).start()

    def emit(self, event: ev.Event) -> dict[str, Any]:
        record = self.hub.call("emit", event)
        self.ended = self.ended or isinstance(event, ev.End)
        return record

    def build(self, attempt: int, world: int) -> Any:
        return make_trainer(
            self.cfg, self._payload(attempt), world, self.run_id, attempt, local=self.local, client=self.client
        )

    def run(self, attempt: int, world: int) -> AttemptOutcome:
        from petatrain.runtime._ray.errors import attempt_failed

        trainer = self.standby.take(attempt, world)
        warm = trainer is not None
        trainer = trainer or self.build(attempt, world)
        self.hub.call("new_attempt", attempt)
        in_driver = getattr(trainer, "controller_in_driver", False)
        controller = "driver" if in_driver else "actor"
        self.emit(ev.AttemptStart(attempt=attempt, world_size=world, controller=controller, warm_controller=warm))
        error = fit(trainer, attempt, world, self.watch, shared_job=self.job.gate is not None)
        if error is None:
            return AttemptOutcome()
        return AttemptOutcome(error=attempt_failed(error, self.causes), hang=self.watch.verdict)

    def rank_died(self, error: AttemptFailed) -> int | None:
        try:
            beats = self.hub.call("heartbeats", timeout=5)
        except Exception:  # a hub that does not answer: the error's own cause stands
            return None
        return cluster.died_on_its_own({(b["pid"], b["node_id"]): rank for rank, b in beats.items()})

    def close(self) -> None:
        self._closed.set()
        self.watch.stop()
        self.standby.discard()

    def _forward_stop(self, stop: threading.Event) -> None:
        """TrainJob.stop, once set, to the hub: the training attempt's ranks stop at the next step boundary."""
        while not self._closed.is_set():
            if stop.wait(0.2):
                try:
                    self.hub.call("request_stop", timeout=30)
                except Exception:  # the run is ending anyway; an attempt that starts now stops after a step
                    log.warning("could not ask the run hub to stop the run", exc_info=True)
                return

    def _stop_after(self) -> float | None:
        return self.started + self.job.stop_after_s if self.job.stop_after_s else None

    def _payload(self, attempt: int) -> Any:
        from petatrain.train.loop import Payload

        job = self.job
        return Payload(
            config=self.cfg.to_dict(),
            run_url=self.run_url,
            options=job.worker_options(),
            hub=self.hub.actor,
            attempt=attempt,
            run_started=self.started,
            injections=list(job.injections),  # the workers leave out those that fired already
            stop_at=time.time() if job.stop is not None and job.stop.is_set() else self._stop_after(),
            hold_at_eval=job.gate is not None,
            carry_step=self.carry_step,
        )
