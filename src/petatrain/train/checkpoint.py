"""Asynchronous, verified, pickle-free checkpoints.

Layout of one checkpoint (DESIGN.md, "Run on storage"):

    RUN/checkpoints/step-00001200/
        rank-00000.safetensors   this rank's tensors: model and optimizer state (DDP: rank 0
                                 only, the replicas are identical; FSDP: every rank its
                                 shards) and the rank's RNG state
        state.json               step, world size, strategy, loader state, optimizer
                                 hyper-parameters, and every file's size and xxh3 checksum
        COMMITTED                written last; holds the checksum of state.json

The training loop pays only for `snapshot()` (a host-memory copy); `CheckpointWriter`
serialises, uploads and commits on a background thread. Every rank writes its own file
and reports its checksum to the run hub; rank 0 waits for all parts, then writes
state.json and COMMITTED. A checkpoint without COMMITTED, whose checksums do not verify,
or whose state.json is not a record resume can rely on (`check_state`), is skipped on
resume in favour of the previous one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file as st_save_file

from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage import StorageOptions, join
from petatrain.storage.checksum import new_digest, verify, verify_digest
from petatrain.storage.fs import (
    atomic_write,
    exists,
    is_local,
    local_staging_path,
    publish_file,
    read_bytes,
    resolve,
)
from petatrain.storage.retry import retrying

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
COMMITTED = "COMMITTED"
STATE = "state.json"

# The writers of this process, for `finish_writes` (a rank's peer failed: its commit in flight is let finish).
_writers: weakref.WeakSet[CheckpointWriter] = weakref.WeakSet()


def step_dir(run_url: str, step: int) -> str:
    return join(run_url, "checkpoints", f"step-{step:08d}")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(slots=True)
class Snapshot:
    """Host-memory copy of one rank's state at a step boundary."""

    step: int
    rank: int
    world_size: int
    tensors: dict[str, torch.Tensor]  # flat names -> CPU tensors (may be empty on DDP ranks > 0)
    meta: dict[str, Any] = field(default_factory=dict)  # JSON: loader state, optimizer groups, ...
    # The training-state tensors `tensors` references instead of copying, and their version
    # counters when taken: the loop must not change them before `CheckpointWriter.wait_for_staging()`.
    live: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class HostBuffers:
    """Host-memory snapshot buffers, allocated once and reused by every checkpoint.

    Allocating fresh host memory per checkpoint made the snapshot pay for page faults on
    every byte (about 2x the copy itself); reused buffers pay only for the copy. On CUDA
    they are pinned, so the device-to-host copies run at full bandwidth. The next
    snapshot must not start before the writer has finished reading them (the loop waits).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        if hasattr(value, "to_local"):  # a DTensor (FSDP): this rank's shard
            value = value.to_local()
        value = value.detach()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            pin = value.device.type == "cuda"
            buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
            self._buffers[name] = buffer
        buffer.copy_(value, non_blocking=value.device.type == "cuda")
        return buffer


def flatten_state(
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    *,
    with_model: bool,
    buffers: HostBuffers | None = None,
    live_ptrs: frozenset[int] = frozenset(),
) -> tuple[dict, dict, list[torch.Tensor]]:
    """(tensors, json, live) of a model + optimizer state dict keyed by parameter name (FQN).

    Tensors are copied to host buffers, except contiguous CPU tensors whose memory starts at
    one of `live_ptrs`: those are referenced as they are, and the state-dict values they
    came from are listed in `live`, to watch their version counters (a storage referenced
    twice, as tied weights are, is copied the second time: safetensors refuses shared memory)."""
    buffers = buffers or HostBuffers()
    tensors: dict[str, torch.Tensor] = {}
    live: list[torch.Tensor] = []
    storages: set[int] = set()

    def take(name: str, value: Any) -> torch.Tensor:
        local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(local, torch.Tensor) and local.data_ptr() in live_ptrs and local.device.type == "cpu":
            storage = local.untyped_storage().data_ptr()
            if local.is_contiguous() and storage not in storages:
                storages.add(storage)
                live.append(value)  # not `local`: a DTensor's in-place updates bump its own version only
                return local.detach()
        return buffers.copy(name, value)

    if with_model:
        for name, value in model_sd.items():
            tensors[f"model/{name}"] = take(f"model/{name}", value)
        for fqn, state in optim_sd["state"].items():
            for key, value in state.items():
                tensors[f"optim/{fqn}/{key}"] = take(f"optim/{fqn}/{key}", value)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies must land before the writer reads
    groups = [{k: v for k, v in g.items()} for g in optim_sd["param_groups"]]
    return tensors, {"param_groups": groups}, live


def split_name(name: str) -> tuple[str, str, str]:
    """A flattened tensor name's parts: ("model", FQN, ""), ("optim", FQN, KEY) or ("rng", NAME, "")."""
    kind, _, rest = name.partition("/")
    if kind == "optim":
        fqn, _, key = rest.rpartition("/")
        return kind, fqn, key
    return kind, rest, ""


def unflatten_state(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        kind, fqn, key = split_name(name)
        if kind == "model":
            model[fqn] = value
        elif kind == "optim":
            optim.setdefault(fqn, {})[key] = value
    return model, optim


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
    """

    def __init__(
        self,
        run_url: str,
        options: StorageOptions | None,
        *,
        report_part: Callable[[int, int, dict], None],
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
        self.error: BaseException | None = None
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

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (snap := self._jobs.get()) is not None:
            try:
                self._writing = True
                self._write(snap)
            except Exception as exc:  # training continues; the next checkpoint tries again
                self.error = exc
                log.error("checkpoint of step %d on rank %d failed: %s", snap.step, snap.rank, exc)
            finally:
                self._writing = False
                self._staged.set()
                self._idle.set()

    def _put(self, url: str, data: bytes) -> tuple[str, int]:
        def attempt() -> tuple[str, int]:
            self.faults.check(url)
            return atomic_write(url, data, self.options)

        return retrying(f"checkpoint write {url}", attempt)

    def _put_tensors(self, url: str, snap: Snapshot, metadata: dict[str, str]) -> tuple[str, int]:
        """Serialise once straight to a staged file (no in-memory copy of the bytes), then publish,
        retrying the publication."""
        staged = local_staging_path(url)
        try:
            t0 = time.perf_counter()
            try:
                st_save_file(snap.tensors, staged, metadata=metadata)
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

            return retrying(f"checkpoint write {url}", attempt)
        finally:
            if os.path.exists(staged):
                os.unlink(staged)

    def _write(self, snap: Snapshot) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        folder = step_dir(self.run_url, snap.step)
        files: dict[str, dict[str, Any]] = {}
        try:
            if snap.tensors or snap.rank == 0:
                metadata = {"step": str(snap.step), "rank": str(snap.rank)}
                checksum, size = self._put_tensors(join(folder, rank_file(snap.rank)), snap, metadata)
                files[rank_file(snap.rank)] = {"checksum": checksum, "bytes": size}
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
        state = {
            "format": FORMAT_VERSION,
            "step": snap.step,
            "world_size": snap.world_size,
            "time": time.time(),
            "files": parts,
            **snap.meta,
        }
        state_bytes = json.dumps(state, indent=1, sort_keys=True).encode()
        state_sum, _ = self._put(join(folder, STATE), state_bytes)
        self._put(join(folder, COMMITTED), json.dumps({"state_checksum": state_sum}).encode())
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


# The files petatrain writes in a checkpoint's folder (a `.tmp-` sibling: a write cut short).
_OWN_FILE = re.compile(r"(COMMITTED|state\.json|rank-\d{5,}\.safetensors)(\.tmp-[0-9a-f]{12})?")


def remove_checkpoint(run_url: str, step: int, options: StorageOptions | None = None) -> bool:
    """Delete the files petatrain wrote in the folder of a committed checkpoint, COMMITTED first
    (a deletion cut short leaves a torn checkpoint, never a committed one missing files); False,
    with nothing deleted, if its record does not check out (it may not be petatrain's).

    Files petatrain does not write stay, and so does their folder."""
    folder = step_dir(run_url, step)
    try:
        read_state(run_url, step, options)
    except CorruptDataError:
        return False
    fs, path = resolve(folder, options)
    fs.invalidate_cache(path)
    entries = retrying(f"list {folder}", lambda: fs.ls(path, detail=True))
    names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "file"]
    ours = sorted((n for n in names if _OWN_FILE.fullmatch(n)), key=lambda n: n != COMMITTED)
    for name in ours:
        with contextlib.suppress(FileNotFoundError):
            retrying(f"remove {folder}/{name}", lambda p=f"{path.rstrip('/')}/{name}": fs.rm_file(p))
    if is_local(folder) and len(ours) == len(entries):
        with contextlib.suppress(OSError):  # a file written there meanwhile: the folder stays
            os.rmdir(path)
    return True


def committed_steps(run_url: str, options: StorageOptions | None = None) -> list[int]:
    """Steps that have a COMMITTED marker, oldest first (not yet verified)."""
    root = join(run_url, "checkpoints")
    if not exists(root, options):
        return []
    fs, path = resolve(root, options)
    fs.invalidate_cache(path)
    steps = []
    for child in fs.ls(path, detail=False):
        name = child.rstrip("/").rsplit("/", 1)[-1]
        # Only the names `step_dir` gives: "step-7" or "step-٠٧" is not a checkpoint of step 7.
        if not re.fullmatch(r"step-[0-9]{8,}", name) or name != f"step-{int(name[5:]):08d}":
            continue
        if fs.exists(f"{child.rstrip('/')}/{COMMITTED}"):
            steps.append(int(name[5:]))
    return sorted(steps)


def read_state(run_url: str, step: int, options: StorageOptions | None = None) -> dict[str, Any]:
    """state.json of a committed checkpoint, checked against COMMITTED and for every field resume
    relies on (`check_state`); CorruptDataError otherwise.

    The rank files are checked by whoever reads them (`read_rank_tensors`)."""
    folder = step_dir(run_url, step)
    try:
        marker = json.loads(read_bytes(join(folder, COMMITTED), options))
        if not isinstance(marker, dict) or not isinstance(marker.get("state_checksum"), str):
            raise ValueError(f"{COMMITTED} holds no state checksum")
        raw = read_bytes(join(folder, STATE), options)
        verify(raw, marker["state_checksum"], join(folder, STATE))
        return check_state(json.loads(raw), step)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep to parse
        raise CorruptDataError(f"checkpoint {folder} does not verify: {exc}") from None


_CHECKSUM = re.compile(r"xxh3-128:[0-9a-f]{32}")
_RANK_FILE = re.compile(r"rank-(\d{5,})\.safetensors")
# The loader's resume state (`StreamingDataset.state_dict`): counts, where the record has them.
_LOADER_COUNTS = ("version", "epoch", "position", "num_samples", "shuffle_window")
_LOADER_SIZES = ("world_size", "batch_size")


def _count(value: Any) -> bool:
    """A non-negative JSON integer (JSON's `true` is not one, though Python's True == 1)."""
    return type(value) is int and value >= 0


def check_state(state: Any, step: int) -> dict[str, Any]:
    """`state` if it is a state.json that resume can rely on for the checkpoint of step `step`;
    ValueError naming the first field that is not.

    COMMITTED's checksum only says state.json is the one committed, not that its writer was
    petatrain: a record edited by hand or by a bug (checksum recomputed) must not steer resume
    (a negative step restarted the run from 0; a rank file left out loaded nothing)."""
    if not isinstance(state, dict):
        raise ValueError(f"{STATE} holds a JSON {type(state).__name__}, not an object")
    if type(state.get("format")) is not int or state["format"] != FORMAT_VERSION:
        raise ValueError(f"format {state.get('format')!r}; this petatrain reads format {FORMAT_VERSION}")
    if not _count(state.get("step")) or state["step"] != step:
        raise ValueError(f"step {state.get('step')!r} recorded in the folder of step {step}")
    world = state.get("world_size")
    if not _count(world) or world < 1:
        raise ValueError(f"world_size {world!r} is not a positive integer")
    _check_files(state.get("files"), world, state.get("strategy"))
    if "strategy" in state and not isinstance(state["strategy"], str):
        raise ValueError(f"strategy {state['strategy']!r} is not a name")
    if "config_digest" in state and not isinstance(state["config_digest"], str):
        raise ValueError(f"config_digest {state['config_digest']!r} is not a string")
    if "loader" in state:
        _check_loader(state["loader"])
    if "param_groups" in state:
        _check_param_groups(state["param_groups"])
    return state


def _check_files(files: Any, world: int, strategy: Any) -> None:
    """Rank files only, of ranks in the world, each with its size and xxh3 checksum; rank 0's
    always (it holds the model under DDP), every rank's under FSDP (each holds its shards)."""
    if not isinstance(files, dict):
        raise ValueError(f"files {str(files)[:80]} is not an object")
    for name, info in files.items():
        match = _RANK_FILE.fullmatch(name)
        if match is None or int(match[1]) >= world:
            raise ValueError(f"files names {name[:80]!r}, not a rank file of world size {world}")
        if not isinstance(info, dict):
            raise ValueError(f"{name}: record {str(info)[:80]} is not an object")
        if not _count(info.get("bytes")):
            raise ValueError(f"{name}: size {info.get('bytes')!r} is not a byte count")
        if not isinstance(info.get("checksum"), str) or not _CHECKSUM.fullmatch(info["checksum"]):
            raise ValueError(f"{name}: checksum {info.get('checksum')!r} is not an xxh3-128 checksum")
    if rank_file(0) not in files:
        raise ValueError(f"files leaves out {rank_file(0)}")
    if strategy == "fsdp" and len(files) != world:  # the names are distinct ranks below `world`
        raise ValueError(f"files names {len(files)} rank files; FSDP over {world} ranks writes one per rank")


def _check_loader(loader: Any) -> None:
    if not isinstance(loader, dict):
        raise ValueError(f"loader state {str(loader)[:80]} is not an object")
    for key in _LOADER_COUNTS + _LOADER_SIZES:
        if key in loader and (not _count(loader[key]) or (key in _LOADER_SIZES and loader[key] < 1)):
            raise ValueError(f"loader state {key} {loader[key]!r} is not a count")
    if "seed" in loader and type(loader["seed"]) is not int:
        raise ValueError(f"loader state seed {loader['seed']!r} is not an integer")
    if "shuffle" in loader and not isinstance(loader["shuffle"], bool):
        raise ValueError(f"loader state shuffle {loader['shuffle']!r} is not true or false")
    if "num_samples" in loader and loader.get("position", 0) > loader["num_samples"]:
        raise ValueError(f"loader state position {loader['position']} is beyond its {loader['num_samples']} samples")


def _check_param_groups(groups: Any) -> None:
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"param_groups {str(groups)[:80]} is not a list of objects")
    for group in groups:
        params = group.get("params", [])
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise ValueError(f"param_groups params {str(params)[:80]} is not a list of parameter names")
        lr = group.get("lr", 0.0)
        if type(lr) not in (int, float) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"param_groups lr {lr!r} is not a learning rate")


def verify_checkpoint(run_url: str, step: int, options: StorageOptions | None = None) -> dict[str, Any]:
    """state.json of a committed checkpoint whose every file is present at its recorded size;
    CorruptDataError otherwise.

    The files' contents are checked against their checksums by whoever reads them
    (`read_rank_tensors`), in the same pass that loads them: verifying here would read the
    whole checkpoint once more, on one rank."""
    state = read_state(run_url, step, options)
    folder = step_dir(run_url, step)
    for name, info in state["files"].items():
        url = join(folder, name)
        fs, path = resolve(url, options)
        try:
            size = retrying(f"stat {url}", lambda fs=fs, path=path: fs.size(path))
        except FileNotFoundError:
            raise CorruptDataError(f"checkpoint {folder} does not verify: {name} is missing") from None
        if size != info["bytes"]:
            raise CorruptDataError(
                f"checkpoint {folder} does not verify: {name} has {size} bytes, {info['bytes']} recorded"
            )
    return state


def latest_verified(
    run_url: str,
    options: StorageOptions | None = None,
    on_skip: Callable[[str, str], None] | None = None,
    *,
    below: int | None = None,
) -> dict[str, Any] | None:
    """The newest checkpoint (older than step `below`, if given) that verifies, skipping torn
    or corrupt ones; its state.json."""
    for step in reversed(committed_steps(run_url, options)):
        if below is not None and step >= below:
            continue
        try:
            return verify_checkpoint(run_url, step, options)
        except CorruptDataError as exc:
            log.warning("skipping checkpoint: %s", exc)
            if on_skip:
                on_skip(step_dir(run_url, step), str(exc))
    return None


def read_rank_tensors(
    run_url: str, state: dict[str, Any], rank: int, options: StorageOptions | None = None
) -> dict[str, torch.Tensor]:
    """The tensors rank `rank` saved in a committed checkpoint; CorruptDataError unless the file
    matches the size and checksum state.json recorded.

    One streamed pass: the bytes are read straight into the tensors and checksummed on the
    way, so a multi-GB rank file is never held in memory besides the tensors it holds."""
    name = rank_file(rank)
    info = state["files"].get(name)
    if info is None:
        return {}
    folder = step_dir(run_url, state["step"])
    url = join(folder, name)
    fs, path = resolve(url, options)

    def attempt() -> dict[str, torch.Tensor]:
        with fs.open(path, "rb") as handle:
            return _read_safetensors(handle, info)

    try:
        return retrying(f"read {url}", attempt)
    except (OSError, ValueError) as exc:
        raise CorruptDataError(f"checkpoint {folder} does not verify: {name}: {exc}") from None


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20
_CHUNK = 64 << 20


def _read_safetensors(handle: Any, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Parse a safetensors file from `handle` into new CPU tensors, checking its size and checksum.

    The header is validated before anything is allocated: the tensors must tile the data
    section exactly (as the format requires), which must end where the recorded size does."""
    digest = new_digest()
    size = int(info["bytes"])
    head = _read_exact(handle, bytearray(8), digest)
    header_len = int.from_bytes(head, "little")
    if not 2 <= header_len <= min(_MAX_HEADER, size - 8):
        raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
    header = json.loads(_read_exact(handle, bytearray(header_len), digest))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    entries = []
    for name, entry in header.items():
        try:
            dtype, shape = _DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]]
            start, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r}: unreadable header entry {entry!r}") from None
        if min(shape, default=0) < 0 or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: offsets {start}..{end} do not fit shape {shape} of {dtype}")
        entries.append((start, end, name, dtype, shape))
    entries.sort(key=lambda e: e[0])
    position = 0
    for start, end, name, _, _ in entries:
        if start != position:
            raise ValueError(f"tensor {name!r} starts at byte {start} of the data, not {position}")
        position = end
    if 8 + header_len + position != size:
        raise ValueError(f"header describes {8 + header_len + position} bytes, {size} recorded")
    tensors: dict[str, torch.Tensor] = {}
    for _, _, name, dtype, shape in entries:
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel():
            _read_exact(handle, tensor.reshape(-1).view(torch.uint8).numpy(), digest)
        tensors[name] = tensor
    if handle.read(1):
        raise ValueError(f"longer than the {size} bytes recorded")
    verify_digest(digest, info["checksum"])
    return tensors


def _read_exact(handle: Any, buffer: Any, digest: Any) -> Any:
    """Fill the writable `buffer` from `handle`, hashing the bytes as they arrive; returns it."""
    view = memoryview(buffer).cast("B")
    filled = 0
    while filled < len(view):
        n = handle.readinto(view[filled : filled + _CHUNK])
        if not n:
            raise ValueError(f"truncated: {len(view) - filled} bytes missing")
        digest.update(view[filled : filled + n])
        filled += n
    return buffer
