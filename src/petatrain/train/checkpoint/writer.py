"""The background checkpoint writer: serialises, uploads and commits while the loop trains.

Every rank writes its own file and reports its checksum to the run hub; rank 0 waits for
all parts, then writes state.json (`CheckpointState`) and COMMITTED last, then applies
retention.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from safetensors.torch import save_file as st_save_file

from petatrain.errors import PetatrainError
from petatrain.security import signing
from petatrain.security.keys import encryption_keys
from petatrain.security.sealed import SealWriter, new_data_key
from petatrain.security.signing import sha256_file
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, local_staging_path, publish_file
from petatrain.storage.retry import retrying
from petatrain.train.checkpoint.reader import committed_steps, file_context, remove_checkpoint
from petatrain.train.checkpoint.state import COMMITTED, STATE, CheckpointState, rank_file, step_dir
from petatrain.train.checkpoint.tensors import Snapshot, write_safetensors
from petatrain.train.run_dir import run_id

log = logging.getLogger(__name__)

# The writers of this process, for `finish_writes` (a rank's peer failed: its commit in flight is let finish).
_writers: weakref.WeakSet[CheckpointWriter] = weakref.WeakSet()


class StorageFaults:
    """Injected object-store failures: the next `count` writes raise a transient error."""

    def __init__(self) -> None:
        self._left = 0
        self._lock = threading.Lock()
        self.raised = 0

    def arm(self, count: int) -> None:
        with self._lock:
            self._left += count

    def check(self, url: str) -> None:
        with self._lock:
            if self._left <= 0:
                return
            self._left -= 1
            self.raised += 1
        raise ConnectionError(f"injected storage fault writing {url}")


class CheckpointWriter:
    """Writes snapshots on a background thread; one write in flight at a time.

    `submit()` returns at once unless the previous write is still running, in which case
    it waits for it; that wait is returned so the loop can count it as stall. A snapshot
    with `live` tensors is serialised from the training state itself: the loop calls
    `wait_for_staging()` before it next changes them (before `optimizer.step()`), and the
    writer checks their version counters once it has read them, so a snapshot that changed
    under it is never committed.
    `parts` is how this rank reports its file and how rank 0 learns the others':
    `report(step, rank, files)` and `wait_parts(step, world_size, timeout) -> files`.
    `keepalive`, called every `keepalive_s` while the loop waits on this rank's own writing:
    such a rank is not hung (the watchdog would otherwise count a long synchronous write, or
    rank 0's commit of a preemption's checkpoint, against `faults.hang_timeout_s`).
    A write that fails for storage (after retries) or because its live snapshot changed is
    logged and left in `error`: training goes on and the next checkpoint tries again. Any
    other failure is a bug and is raised on the loop's thread by `raise_if_broken()`.
    """

    def __init__(
        self,
        run_url: str,
        options: StorageOptions | None,
        *,
        report_part: Callable[[int, int, dict | None], None],
        wait_parts: Callable[[int, int, float], dict | None],
        on_commit: Callable[[dict[str, Any]], None],
        keep_last: int = 3,
        keep_every: int = 0,
        faults: StorageFaults | None = None,
        parts_timeout_s: float = 120.0,
        keepalive: Callable[[], None] | None = None,
        keepalive_s: float = 1.0,
    ):
        self.run_url, self.options = run_url, options
        self._report_part, self._wait_parts, self._on_commit = report_part, wait_parts, on_commit
        self.keep_last, self.keep_every = keep_last, keep_every
        self.faults = faults or StorageFaults()
        self.parts_timeout_s = parts_timeout_s
        self._keepalive, self._keepalive_s = keepalive, keepalive_s
        self._writing = False  # this rank's files or its commit are being written (not waiting on peers)
        self._jobs: queue.Queue[Snapshot | None] = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._staged = threading.Event()  # the current write no longer reads the snapshot's tensors
        self._staged.set()
        self.error: BaseException | None = None  # the last write's failure, None after a success
        self._broken: BaseException | None = None  # a failure that is not storage's, for the loop to raise
        self.live_refused = False  # a live snapshot changed while being written: copy from now on
        self.last_staging_s: float | None = None  # serialising the last snapshot (reading its tensors)
        self.last_write_s = 0.0
        self.last_write_cpu_s = 0.0  # CPU time of this thread for the last write (it competes with training on CPU)
        self.committed_step: int | None = None  # rank 0: the newest step this writer committed
        self._left_alone: set[int] = set()  # old checkpoints retention found not to be petatrain's
        self._thread = threading.Thread(target=self._run, name="petatrain-ckpt", daemon=True)
        self._thread.start()
        _writers.add(self)

    def submit(self, snap: Snapshot) -> float:
        """Queue a snapshot; returns the seconds spent waiting for the previous write."""
        t0 = time.perf_counter()
        self._await(self._idle)
        waited = time.perf_counter() - t0
        self._idle.clear()
        if snap.live:
            self._staged.clear()
        self._jobs.put(snap)
        return waited

    def wait_for_staging(self) -> float:
        """Block until the write in flight has read its live tensors; returns the seconds waited."""
        if self._staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._await(self._staged)
        return time.perf_counter() - t0

    def wait(self) -> float:
        t0 = time.perf_counter()
        self._await(self._idle)
        return time.perf_counter() - t0

    def idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the write in flight (none: at once); True once none is."""
        return self._idle.wait(timeout_s)

    def _await(self, event: threading.Event) -> None:
        if self._keepalive is None:
            event.wait()
            return
        while not event.wait(self._keepalive_s):
            if self._writing:  # not while rank 0 waits for the others' parts: a hung peer is a hang
                self._keepalive()

    def raise_if_broken(self) -> None:
        """Raise, on the caller's thread, a write failure that was a bug rather than storage's."""
        broken, self._broken = self._broken, None
        if broken is not None:
            raise broken

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (snap := self._jobs.get()) is not None:
            try:
                self._writing = True
                self._write(snap)
                self.error = None
            except (OSError, PetatrainError) as exc:  # training continues; the next checkpoint tries again
                self.error = exc
                log.error("checkpoint of step %d on rank %d failed: %s", snap.step, snap.rank, exc)
            except Exception as exc:
                self.error = self._broken = exc
                log.exception("checkpoint of step %d on rank %d failed", snap.step, snap.rank)
            finally:
                self._writing = False
                self._staged.set()
                self._idle.set()

    def _put(self, url: str, data: bytes) -> tuple[str, int]:
        def attempt() -> tuple[str, int]:
            self.faults.check(url)
            return atomic_write(url, data, self.options)

        return retrying(f"checkpoint write {url}", attempt)

    def _put_tensors(self, url: str, snap: Snapshot, metadata: dict[str, str]) -> dict[str, Any]:
        """Serialise once straight to a staged file (no in-memory copy of the bytes; sealed on the
        way when the run is encrypted), then publish, retrying the publication; the file's record."""
        staged = local_staging_path(url)
        record: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            try:
                record = self._stage(staged, snap, metadata)
            finally:
                changed = [t._version for t in snap.live] != snap.versions
                self._staged.set()  # the loop may change the tensors again
            self.last_staging_s = time.perf_counter() - t0
            if changed:
                self.live_refused = True
                raise PetatrainError(
                    f"checkpoint step {snap.step}: the weights changed while they were written (the model "
                    "writes them outside optimizer.step); not committed, later snapshots are copied"
                )

            def attempt() -> tuple[str, int]:
                self.faults.check(url)
                return publish_file(url, staged, self.options, consume=False)

            checksum, size = retrying(f"checkpoint write {url}", attempt)
            return {"checksum": checksum, "bytes": size, **record}
        finally:
            if os.path.exists(staged):
                os.unlink(staged)

    def _stage(self, staged: str, snap: Snapshot, metadata: dict[str, str]) -> dict[str, Any]:
        """Write the snapshot's tensors to the local file `staged`: as safetensors, sealed with a
        fresh data key when the run is encrypted; what the record adds (data key, SHA-256)."""
        record: dict[str, Any] = {}
        keys = encryption_keys(self.options)
        if keys is None:
            st_save_file(snap.tensors, staged, metadata=metadata)
        else:
            name = rank_file(snap.rank)
            context = file_context(self.run_url, snap.step, name, self.options)
            key, record["encryption"] = new_data_key(keys, context)
            with open(staged, "wb") as handle:
                sealed = SealWriter(handle, key, context)
                write_safetensors(snap.tensors, metadata, sealed)
                sealed.close()
        if signing.signs(self.options):
            record[signing.SHA256] = sha256_file(staged)
        return record

    def _write(self, snap: Snapshot) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if snap.pending is not None:  # staged on the GPU: into the host buffers, while training goes on
            snap.pending.fill(snap.tensors)
        folder = step_dir(self.run_url, snap.step)
        files: dict[str, dict[str, Any]] = {}
        try:
            if snap.tensors or snap.rank == 0:
                metadata = {"step": str(snap.step), "rank": str(snap.rank)}
                files[rank_file(snap.rank)] = self._put_tensors(join(folder, rank_file(snap.rank)), snap, metadata)
        except Exception:
            self._report_part(snap.step, snap.rank, None)  # rank 0 stops waiting: no commit of this step
            raise
        self._report_part(snap.step, snap.rank, files)
        if snap.rank != 0:
            self.last_write_s, self.last_write_cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
            return
        self._writing = False
        parts = self._wait_parts(snap.step, snap.world_size, self.parts_timeout_s)
        self._writing = True
        if parts is None:
            raise PetatrainError(f"checkpoint step {snap.step}: not every rank wrote its part; not committed")
        keys = {name: info.pop("encryption") for name, info in parts.items() if "encryption" in info}
        # The snapshot's meta holds the loop's fields (loader, strategy, param_groups, config_digest).
        state = CheckpointState(step=snap.step, world_size=snap.world_size, time=time.time(), files=parts, **snap.meta)
        state_bytes = json.dumps(state.to_json(), indent=1, sort_keys=True).encode()
        state_sum, _ = self._put(join(folder, STATE), state_bytes)
        run = run_id(self.run_url, self.options) if keys else ""  # what the data keys are bound to
        self._put(join(folder, COMMITTED), commit_record(state_bytes, state_sum, keys, self.options, run=run))
        self.last_write_s, self.last_write_cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
        nbytes = sum(f["bytes"] for f in parts.values()) + len(state_bytes)
        self.committed_step = snap.step
        self._on_commit({"step": snap.step, "write_s": self.last_write_s, "bytes": nbytes, "url": folder})
        self._retain()

    def _retain(self) -> None:
        steps = committed_steps(self.run_url, self.options)
        keep = set(steps[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s in keep or s in self._left_alone:
                continue
            if not remove_checkpoint(self.run_url, s, self.options):
                self._left_alone.add(s)  # warned once
                log.warning("retention leaves %s: not a petatrain checkpoint that verifies", step_dir(self.run_url, s))


def commit_record(
    state_bytes: bytes,
    state_sum: str,
    keys: dict[str, Any],
    options: StorageOptions | None,
    *,
    sign: bool = True,
    run: str = "",
) -> bytes:
    """COMMITTED: the checksum of state.json, the files' wrapped data keys when encrypted with the id
    of the run they are bound to (`run`), and when signing (`sign` and a signing key), state.json's
    SHA-256 and the signature over all of it."""
    record: dict[str, Any] = {"state_checksum": state_sum}
    if keys:
        record["keys"] = keys
        if run:
            record["run"] = run
    if sign and signing.signs(options):
        record["state_sha256"] = signing.sha256_hex(state_bytes)
        record["signature"] = signing.sign(options, signing.canonical(record))
    return json.dumps(record).encode()


def finish_writes(timeout_s: float) -> dict[str, Any]:
    """Let this process's checkpoint writes in flight finish, for up to `timeout_s`.

    Run on rank 0 of an attempt that failed elsewhere, before Ray Train kills its workers:
    the failed rank's part of the checkpoint is already written, and rank 0's own file and
    commit would otherwise be cut short, resuming the run from the checkpoint before
    (a whole checkpoint interval recomputed). Returns {"done": no write left in flight,
    "committed": the newest step committed here, or None}.
    """
    deadline = time.monotonic() + timeout_s
    writers = list(_writers)
    done = all([w.idle(max(0.0, deadline - time.monotonic())) for w in writers])
    steps = [w.committed_step for w in writers if w.committed_step is not None]
    return {"done": done, "committed": max(steps, default=None)}
