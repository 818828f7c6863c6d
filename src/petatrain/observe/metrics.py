"""Prometheus metrics of a training run, fed by the same events that go into the ledger.

    metrics = MetricsServer(port=0)             # 127.0.0.1, a free port: metrics.port
    metrics.observe(events.Step(attempt=0, step=1, ...))  # or a ledger line (dict)
    ...
    metrics.close()

Every metric is named `petatrain_*`. The goodput gauge is the same quantity
`goodput.account` reports (productive time of kept steps over wall time), kept up to
date in O(1) per event so that the driver can feed it every event of a long run.

Prometheus finds a run through `RUN/prometheus/targets.json` (`file_sd_targets`, its file-based
service discovery format), and the server notes when it is scraped, so that the driver can keep
it up until the scrape after a run's end has read the final values (`wait_for_scrape`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from array import array
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from petatrain.observe import events as ev
from petatrain.observe.events import Event

log = logging.getLogger(__name__)


class MetricsServer:
    """An HTTP endpoint serving a run's metrics; `observe(event)` updates them from ledger events."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        # A registry of its own: two runs (or two tests) in one process do not share metrics.
        self.registry = CollectorRegistry()
        # Registered first, so that a scrape is dated before any value of it is read.
        self._scrapes = _ScrapeClock()
        self.registry.register(self._scrapes)
        gauge, counter = self._gauge, self._counter
        self.step = gauge("petatrain_step", "Last step completed")
        self.attempt = gauge("petatrain_attempt", "Attempt in progress (0 = the first, +1 per restart)")
        self.step_seconds = gauge("petatrain_step_seconds", "Duration of the last step, data wait included")
        self.data_wait_seconds = gauge("petatrain_step_data_wait_seconds", "Data wait of the last step")
        self.tokens_per_second = gauge("petatrain_tokens_per_second", "Tokens per second of the last step")
        self.loss = gauge("petatrain_loss", "Training loss of the last step")
        self.eval_loss = gauge("petatrain_eval_loss", "Loss of the last evaluation")
        self.checkpoint_stall_seconds = gauge(
            "petatrain_last_checkpoint_stall_seconds", "Training-loop stall of the last checkpoint snapshot"
        )
        self.goodput = gauge("petatrain_goodput", "Productive time of kept steps over wall time so far (0..1)")
        self.steps_total = counter("petatrain_steps", "Steps completed, recomputed ones included")
        self.tokens_total = counter("petatrain_tokens", "Tokens processed, recomputed steps included")
        self.data_wait_total = counter("petatrain_data_wait_seconds", "Time the training loop waited for data")
        self.checkpoint_stall_total = counter(
            "petatrain_checkpoint_stall_seconds", "Time the training loop paid for checkpoint snapshots"
        )
        self.checkpoints_total = counter("petatrain_checkpoints_committed", "Checkpoints committed")
        self.restarts_total = counter("petatrain_restarts", "Restarts after a failure")
        self.failures_total = counter("petatrain_failures", "Failures, by cause", "cause")
        # A pipeline's stages, by the rank that runs them (the first replica's), at each checkpoint.
        self.stage_busy_total = counter(
            "petatrain_pipeline_stage_compute_seconds", "Time a pipeline rank's stages computed", "rank"
        )
        self.stage_wall_total = counter(
            "petatrain_pipeline_stage_step_seconds", "Time a pipeline rank spent in schedule steps", "rank"
        )
        self.stage_idle = Gauge(
            "petatrain_pipeline_stage_idle_share",
            "Idle share of a pipeline rank's steps in its last report (the bubble and the transfers)",
            ["rank"],
            registry=self.registry,
        )

        self._lock = threading.Lock()
        self._t_start: float | None = None
        self._t_last: float | None = None
        self._productive_of_step = array("d")  # productive seconds of the latest occurrence of each step
        self._productive = 0.0

        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = int(self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, registry=self.registry)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def observe(self, line: Event | dict[str, Any]) -> None:
        """Update the metrics from one ledger event, or its line (read as `events.read` reads it:
        a line that fits no event only marks the time)."""
        typed = [line] if isinstance(line, Event) else ev.read([line])
        with self._lock:
            for event in typed:
                self._observe(event)
            if self._t_start is not None and self._t_last is not None and self._t_last > self._t_start:
                self.goodput.set(self._productive / (self._t_last - self._t_start))

    def _observe(self, event: Event) -> None:
        t = event.t
        if isinstance(event, ev.RunStart) or self._t_start is None:
            self._t_start = t if self._t_start is None else min(self._t_start, t)
        self._t_last = t if self._t_last is None else max(self._t_last, t)
        if isinstance(event, ev.AttemptStart | ev.Restart | ev.Resume):
            self.attempt.set(event.attempt)
        if isinstance(event, ev.Step):
            self._observe_step(event)
        elif isinstance(event, ev.CheckpointSnapshot):
            stall = max(event.stall_s, 0.0)
            self.checkpoint_stall_seconds.set(stall)
            self.checkpoint_stall_total.inc(stall)
        elif isinstance(event, ev.CheckpointCommit):
            self.checkpoints_total.inc()
        elif isinstance(event, ev.Eval):
            self.eval_loss.set(event.loss)
        elif isinstance(event, ev.Failure):
            self.failures_total.labels(cause=event.cause or "unknown").inc()
        elif isinstance(event, ev.Restart):
            self.restarts_total.inc()
        elif isinstance(event, ev.PipelineStage):
            self._observe_stage(event)

    def _observe_stage(self, event: ev.PipelineStage) -> None:
        busy, wall = event.busy_s, event.wall_s
        if busy < 0 or wall <= 0:
            return
        rank = str(event.rank)
        self.stage_busy_total.labels(rank=rank).inc(busy)
        self.stage_wall_total.labels(rank=rank).inc(wall)
        self.stage_idle.labels(rank=rank).set(max(0.0, 1 - busy / wall))

    def _observe_step(self, event: ev.Step) -> None:
        step = event.step
        step_s = max(event.step_s, 0.0)
        wait = min(max(event.data_wait_s, 0.0), step_s)
        tokens = event.tokens
        self.steps_total.inc()
        self.step_seconds.set(step_s)
        self.data_wait_seconds.set(wait)
        self.data_wait_total.inc(wait)
        if tokens > 0:
            self.tokens_total.inc(tokens)
            if step_s > 0:
                self.tokens_per_second.set(tokens / step_s)
        if event.loss is not None:
            self.loss.set(event.loss)
        if step < 0:
            return
        self.step.set(step)
        # A step number seen again replaces its earlier, now lost, occurrence (as in goodput.account).
        index = int(step)
        if index >= len(self._productive_of_step):
            self._productive_of_step.extend([0.0] * (index + 1 - len(self._productive_of_step)))
        self._productive += (step_s - wait) - self._productive_of_step[index]
        self._productive_of_step[index] = step_s - wait

    @property
    def last_scrape(self) -> float | None:
        """When (unix seconds) the endpoint was last scraped; None if never."""
        return self._scrapes.last

    def wait_for_scrape(self, after: float, timeout_s: float) -> bool:
        """Wait until a scrape that began after `after` (unix seconds) has read the metrics, at
        most `timeout_s`; whether one did."""
        return self._scrapes.wait_after(after, timeout_s)

    def close(self) -> None:
        """Stop serving; the port is free again when this returns."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ScrapeClock:
    """A collector that yields no metric and notes when a scrape asks for them."""

    def __init__(self) -> None:
        self.last: float | None = None
        self._scraped = threading.Condition()

    def describe(self) -> list[Any]:  # registering it must not count as a scrape
        return []

    def collect(self) -> list[Any]:
        with self._scraped:
            self.last = time.time()
            self._scraped.notify_all()
        return []

    def wait_after(self, after: float, timeout_s: float) -> bool:
        with self._scraped:
            return self._scraped.wait_for(lambda: self.last is not None and self.last > after, timeout=timeout_s)


TARGETS_FILE = "prometheus/targets.json"  # in the run directory


def file_sd_targets(url: str, labels: dict[str, str]) -> bytes:
    """The metrics endpoint at `url` as a Prometheus file-based service discovery file
    (`file_sd_configs`), its series labelled with `labels`."""
    parts = urlsplit(url)
    target: dict[str, Any] = {"targets": [parts.netloc], "labels": dict(labels)}
    if parts.path and parts.path != "/metrics":
        target["labels"]["__metrics_path__"] = parts.path
    return (json.dumps([target], indent=2) + "\n").encode()
