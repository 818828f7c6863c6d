"""An ingest asked for through Ray Client (`--address ray://...`): its driver runs on the cluster.

The whole ingest (`data.ingest.run`: lease, stages, commit) runs as one task on the cluster,
holding no CPU of its own, while this process waits for it: its stages' tasks are submitted and
awaited next to the data, not across the client's link. Each stage's start and end reach the caller's
`on_stage` through a small actor as they happen; an error raised there comes back as itself.
Sources, the dataset and a keyring named by `file:` must be where the cluster's nodes can read
them, as for any ingest on a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import ray

from petatrain.data.ingest.job import IngestJob, IngestSummary
from petatrain.storage import StorageOptions
from petatrain.storage.fs import is_local

log = logging.getLogger(__name__)

_POLL_S = 1.0  # the longest a stage's line waits for the caller's poll (an event answers it at once)


@ray.remote(num_cpus=0, max_concurrency=2)
class StageRelay:
    """The stages the ingest task has started and ended, in order, for the caller to pick up."""

    def __init__(self) -> None:
        self._events: list[tuple[str, str]] = []
        self._changed = threading.Condition()

    def stage(self, name: str, what: str) -> None:
        with self._changed:
            self._events.append((name, what))
            self._changed.notify_all()

    def since(self, seen: int, wait_s: float) -> list[tuple[str, str]]:
        """The events after the first `seen`, waiting up to `wait_s` for one."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._events) > seen, timeout=wait_s)
            return self._events[seen:]


@ray.remote(num_cpus=0, max_retries=0)
def _ingest_on_cluster(job: IngestJob, relay: Any) -> IngestSummary:
    from petatrain.data.ingest import run

    # Synchronous: every event is in the relay before the summary is returned.
    return run(dataclasses.replace(job, on_stage=lambda name, what: ray.get(relay.stage.remote(name, what))))


def run_on_cluster(job: IngestJob) -> IngestSummary:
    """Run `job` on the Ray cluster this process joined through Ray Client (`job.connect` joins it)."""
    started = time.perf_counter()
    if job.on_stage:
        job.on_stage("ray_init", "start")
    if job.connect is not None:
        job.connect()
    connected = time.perf_counter() - started
    if job.on_stage:
        job.on_stage("ray_init", "done")
    # The task's working directory is not this process's: local paths go as absolute ones.
    remote = dataclasses.replace(
        job,
        sources=[os.path.abspath(s) if is_local(s) and "://" not in s else s for s in job.sources],
        out=os.path.abspath(job.out) if is_local(job.out) and "://" not in job.out else job.out,
        connect=None,
        on_stage=None,
        on_progress=None,  # the stages' ends are relayed; progress within a stage is not
        options=(job.options or StorageOptions()).for_workers(),  # the cluster has not this process's AWS_*
    )
    relay = StageRelay.remote()  # type: ignore[attr-defined]
    done = _ingest_on_cluster.remote(remote, relay)
    try:
        seen = 0
        while True:
            finished = bool(ray.wait([done], timeout=0)[0])
            events = ray.get(relay.since.remote(seen, 0 if finished else _POLL_S))
            seen += len(events)
            for name, what in events:
                if job.on_stage:
                    job.on_stage(name, what)
            if finished:
                break
        summary = ray.get(done)
    except KeyboardInterrupt:
        ray.cancel(done, force=True)  # its lease then lapses; the next writer takes it over
        raise
    finally:
        with contextlib.suppress(Exception):  # the connection may be what failed
            ray.kill(relay)
    summary.dataset = job.out
    summary.stage_seconds = {"ray_init": round(connected, 3), **summary.stage_seconds}
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary
