"""The run hub: one small Ray actor per run, on the driver's node, that outlives worker restarts.

It owns the event ledger (workers on any node send events here; the ledger may live on an
object store that cannot be appended to), receives step heartbeats for the hang watchdog,
collects the checkpoint parts of every rank so rank 0 can commit, and remembers which
injected faults already fired so that none fires again after the resume.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import ray

from petatrain.observe.ledger import EventLog
from petatrain.storage import StorageOptions


@ray.remote(num_cpus=0, concurrency_groups={"ledger": 1, "parts": 16, "watch": 2, "linger": 1})
class RunHub:
    """Ledger writes run on one thread ("ledger") so events land in the order they were sent;
    checkpoint-part waits, the watchdog's long poll and the wait for the metrics' last scrape block
    threads of their own ("parts", "watch", "linger")."""

    def __init__(
        self,
        run_url: str,
        options: StorageOptions | None,
        metrics_host: str = "",
        metrics_port: int = 0,
        fired: list[str] | None = None,
        hold_until_a_step: bool = False,
    ):
        from petatrain.observe.metrics import MetricsServer

        self.log = EventLog(run_url, options)
        # Continuing a run that ended ok: its record changes only once the continuation trains a step;
        # events wait here until then, and are dropped if that never comes.
        self.held: list[dict[str, Any]] | None = [] if hold_until_a_step else None
        # Prometheus endpoint fed by every event; bound to 127.0.0.1 unless observe.metrics_host says otherwise.
        self.metrics = MetricsServer(metrics_host or "127.0.0.1", metrics_port) if metrics_host else None
        self._lock = threading.Condition()
        self.attempt = -1
        self.beats: dict[int, dict[str, Any]] = {}
        self.lost: set[int] = set()  # ranks of the ending attempt that are gone (attempt_failed)
        self.draining = False  # the attempt failed and its survivors finish their checkpoint writes
        self.parts: dict[tuple[int, int], dict[int, dict | None]] = {}  # (attempt, step) -> rank -> files
        self.fired: set[str] = set(fired or ())  # an earlier driver's are in the ledger
        self.resize_to: dict[int, int] = {}  # attempt -> the worker count the driver asked it to restart on
        # Evaluations the run waits at (Payload.hold_at_eval): the step held, the newest released.
        self.holding: int | None = None
        self.released = -1
        self.groups: set[str] = set()  # the attempts' placement groups (worker_start events)
        self.last_flush = time.time()
        # What the health endpoint reports (runtime.health), kept from the events as they pass.
        self.phase = {"state": "starting", "started_t": time.time(), "attempt_t": None, "step": None}

    # -- ledger ------------------------------------------------------------------------------
    @ray.method(concurrency_group="ledger")
    def emit(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        record = self.log.record(event, **fields)
        if self.held is None:
            self.log.write(record)
        else:
            self.held.append(record)
            if event == "step":
                for waiting in self.held:  # the continuation started: its record is the run's now
                    self.log.write(waiting)
                self.held = None
        self._track(record)
        if self.metrics is not None:
            self.metrics.observe(record)
        if time.time() - self.last_flush > 5:
            self.flush()
        return record

    # The state each event puts the run in (an end: finished or failed).
    _STATES: ClassVar[dict[str, str]] = {
        "run_start": "starting",
        "run_continue": "starting",
        "attempt_start": "starting",
        "step": "training",
        "checkpoint_snapshot": "checkpointing",
        "checkpoint_commit": "training",
        "checkpoint_skipped": "training",
        "failure": "restarting",
        "restart": "restarting",
    }

    def _track(self, record: dict[str, Any]) -> None:
        event = record.get("event", "")
        with self._lock:
            if event == "end":
                self.phase["state"] = "finished" if record.get("status") == "ok" else "failed"
            elif event == "attempt_start" and self.phase["state"] == "restarting":
                pass  # restarting until the new attempt's first step
            elif event in self._STATES:
                self.phase["state"] = self._STATES[event]
            if event == "attempt_start":
                self.phase["attempt_t"], self.phase["step"] = record.get("t"), None  # steps of this attempt
            if event == "worker_start" and record.get("placement_group"):
                self.groups.add(str(record["placement_group"]))
            if event == "step" and isinstance(record.get("step"), int):
                self.phase["step"] = max(self.phase["step"] or 0, record["step"])

    def placement_groups(self) -> list[str]:
        with self._lock:
            return sorted(self.groups)

    def health(self) -> dict[str, Any]:
        """The run's state for the driver's health endpoint: state, attempt, newest step and when."""
        with self._lock:
            beats = [b["t"] for b in self.beats.values() if b["step"] >= 0]
            return {**self.phase, "attempt": self.attempt, "last_step_t": max(beats, default=None)}

    @ray.method(concurrency_group="ledger")
    def emit_many(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Several events in one call (the loop batches its step events), in order."""
        for event, fields in events:
            self.emit(event, fields)

    @ray.method(concurrency_group="ledger")
    def telemetry(
        self,
        events: list[tuple[str, dict[str, Any]]],
        attempt: int,
        rank: int,
        step: int,
        pid: int,
        node_id: str,
        age_s: float = 0.0,
    ) -> int | None:
        """A rank's batched events and its heartbeat: one actor call per flush of the loop. Returns
        the worker count the driver asked this attempt to restart on (`request_resize`), if it did."""
        self.emit_many(events)
        self.beat(attempt, rank, step, pid, node_id, age_s)
        return self.resize_to.get(attempt)

    @ray.method(concurrency_group="ledger")
    def started(self) -> bool:
        """Whether the run's record is being written (not held: see `hold_until_a_step`)."""
        return self.held is None

    @ray.method(concurrency_group="ledger")
    def flush(self) -> None:
        self.log.flush()
        self.last_flush = time.time()

    def metrics_url(self) -> str | None:
        """Where Prometheus reaches the metrics: an endpoint on every interface is named by this node's address."""
        if self.metrics is None:
            return None
        host = self.metrics.host
        if host in ("0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.metrics.port}/metrics"

    @ray.method(concurrency_group="linger")
    def last_scrape(self, max_s: float) -> bool:
        """Called once the run's end is in the metrics: wait, at most `max_s`, for a scrape to read
        them, if anything scrapes this endpoint at all; whether one did."""
        if self.metrics is None or max_s <= 0 or self.metrics.last_scrape is None:
            return False
        scraped = self.metrics.wait_for_scrape(time.time(), max_s)
        if scraped:
            time.sleep(0.2)  # the values are read; let the answer reach the scraper before the port closes
        return scraped

    @ray.method(concurrency_group="ledger")
    def close(self) -> None:
        self.log.close()
        if self.metrics is not None:
            self.metrics.close()

    # -- attempts and heartbeats ---------------------------------------------------------------
    def new_attempt(self, attempt: int) -> None:
        with self._lock:
            self.attempt = attempt
            self.beats, self.lost, self.draining = {}, set(), False
            # A waiter of a failed attempt must not take the parts of the new one.
            self.parts = {k: v for k, v in self.parts.items() if k[0] >= attempt}
            self._lock.notify_all()

    def beat(self, attempt: int, rank: int, step: int, pid: int, node_id: str, age_s: float = 0.0) -> None:
        """A rank reached `step`, which ended `age_s` ago; "t" is when, on this node's clock
        (an age, not the worker's timestamp, so clocks of other nodes do not matter)."""
        with self._lock:
            if attempt == self.attempt:
                self.beats[rank] = {"t": time.time() - age_s, "step": step, "pid": pid, "node_id": node_id}
                self._lock.notify_all()  # a waiting watch() moves its hang deadline

    def attempt_failed(self, attempt: int, lost: list[int]) -> None:
        """The attempt is ending on a failure, and the ranks in `lost` are gone: a checkpoint
        waiting for one of their parts is given up at once, and while the survivors finish
        their writes (`checkpoint.finish_writes`) no rank counts as hung."""
        with self._lock:
            if attempt == self.attempt:
                self.lost, self.draining = set(lost), True
                self._lock.notify_all()

    def request_resize(self, attempt: int, world: int) -> None:
        """The cluster can host `world` workers now: the attempt's rank 0 hears it in its next
        telemetry answer and the ranks stop together after a checkpoint (`train.rank.Resized`)."""
        with self._lock:
            self.resize_to[attempt] = world

    def heartbeats(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self.beats)

    @ray.method(concurrency_group="watch")
    def watch(self, attempt: int, timeout_s: float, announced: bool, wait_s: float) -> dict[str, Any]:
        """Answers the driver's watchdog once it has something to act on, or after `wait_s`.

        Something to act on: a new attempt; the attempt's first step, unless `announced`; no
        step progress on any rank for `timeout_s` (three times that before the first step):
        then "stale_s" says for how long. A long poll, where the watchdog used to ask twice a
        second: ~0.004 cores fewer of the hub's and the driver's CPU on 2 cores, and a hang
        is returned when it is due. {"beats": heartbeats, "stepped": bool, "stale_s": float | None}.
        """
        end = time.time() + wait_s
        with self._lock:
            while True:
                now, beats = time.time(), self.beats
                stepped = any(b["step"] >= 0 for b in beats.values())
                due, last = end, None
                # No beat yet (the attempt is starting) or draining (a failed attempt's survivors
                # finish their checkpoint writes): nothing to call hung.
                if beats and not self.draining and self.holding is None:
                    last = max(b["t"] for b in beats.values())
                    due = min(end, last + (timeout_s if stepped else 3 * timeout_s))
                stale_s = now - last if last is not None and now >= due and due < end else None  # None unless hung
                if attempt != self.attempt or (stepped and not announced) or stale_s is not None or now >= end:
                    return {"beats": dict(beats), "stepped": stepped, "stale_s": stale_s}
                self._lock.wait(due - now)

    # -- holds at evaluations -------------------------------------------------------------------
    @ray.method(concurrency_group="parts")
    def hold(self, attempt: int, step: int) -> None:
        """Rank 0 waits here after the evaluation of `step` until `release(step)`: no hang meanwhile.
        A step released before (an attempt that trains it again after a restart) is not held."""
        with self._lock:
            self.holding = step
            self._lock.notify_all()
            while self.released < step and attempt == self.attempt:
                self._lock.wait(1.0)
            self.holding = None
            for rank in self.beats:  # the hang clock starts again from the release
                self.beats[rank]["t"] = time.time()
            self._lock.notify_all()

    def release(self, step: int) -> None:
        with self._lock:
            self.released = max(self.released, step)
            self._lock.notify_all()

    # -- checkpoint parts ----------------------------------------------------------------------
    @ray.method(concurrency_group="parts")
    def report_part(self, attempt: int, step: int, rank: int, files: dict | None) -> None:
        """A rank's written files for a checkpoint, or None when its write failed."""
        with self._lock:
            self.parts.setdefault((attempt, step), {})[rank] = files
            self._lock.notify_all()

    @ray.method(concurrency_group="parts")
    def wait_parts(self, attempt: int, step: int, world_size: int, timeout_s: float) -> dict | None:
        """Every rank's files of a checkpoint, or None on timeout or when the attempt is over."""
        deadline = time.time() + timeout_s
        key = (attempt, step)
        with self._lock:
            while len(self.parts.get(key, {})) < world_size:
                got = self.parts.get(key, {})
                if any(files is None for files in got.values()):
                    self.parts.pop(key)
                    return None  # a rank's write failed
                if attempt == self.attempt and self.lost - got.keys():
                    return None  # a rank that has not written its part is gone
                left = deadline - time.time()
                if left <= 0 or attempt != self.attempt:
                    return None
                self._lock.wait(left)
            got = self.parts.pop(key)
        written = [files for files in got.values() if files is not None]
        if len(written) < len(got):
            return None  # a rank's write failed
        return {name: info for files in written for name, info in files.items()}

    # -- fault injection -----------------------------------------------------------------------
    @ray.method(concurrency_group="ledger")
    def fire(self, key: str, fields: dict[str, Any]) -> bool:
        """True the first time `key` fires; the fault_injected event is written before it acts."""
        with self._lock:
            if key in self.fired:
                return False
            self.fired.add(key)
        self.log.emit("fault_injected", **fields)
        self.flush()
        return True

    def fired_keys(self) -> list[str]:
        with self._lock:
            return sorted(self.fired)
