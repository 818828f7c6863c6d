"""Finding, verifying and reading committed checkpoints; deleting one (retention).

A checkpoint without COMMITTED, whose checksums do not verify, or whose state.json is not a
record resume can rely on (`check_state`), is skipped in favour of the previous one. A rank
file is read in one streamed pass that fills the tensors and checks the checksum on the way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from petatrain.errors import CorruptDataError
from petatrain.security import signing
from petatrain.security.keys import encryption_keys
from petatrain.security.sealed import SealReader, data_key
from petatrain.security.signing import SHA256
from petatrain.storage import StorageOptions, join
from petatrain.storage.checksum import new_digest, verify, verify_digest
from petatrain.storage.fs import exists, is_local, read_bytes, resolve
from petatrain.storage.retry import retrying
from petatrain.train.checkpoint.state import COMMITTED, STATE, CheckpointState, rank_file, step_dir
from petatrain.train.checkpoint.tensors import DTYPES
from petatrain.train.run_dir import run_id

log = logging.getLogger(__name__)


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
        if is_local(root) and os.path.islink(child):  # another run's checkpoint, say: never ours to read or delete
            _warn_link(child)
            continue
        if fs.exists(f"{child.rstrip('/')}/{COMMITTED}"):
            steps.append(int(name[5:]))
    return sorted(steps)


_warned_links: set[str] = set()


def _warn_link(path: str) -> None:
    if path not in _warned_links:  # once per process: committed_steps is called at every checkpoint
        _warned_links.add(path)
        log.warning("%s is a symbolic link, not a checkpoint this run wrote: left alone", path)


def read_state(run_url: str, step: int, options: StorageOptions | None = None) -> CheckpointState:
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
        signed = signing.check(options, signing.canonical(marker), marker.get("signature"), f"checkpoint {folder}")
        if signed and marker.get("state_sha256") != signing.sha256_hex(raw):
            raise ValueError(f"{STATE} does not match the SHA-256 its signed {COMMITTED} records")
        state = CheckpointState.from_json(json.loads(raw), step)
        if signed and not all(isinstance(f.get(SHA256), str) for f in state.files.values()):
            raise ValueError(f"a file of the signed {STATE} has no SHA-256")
        state.keys = _sealed_files(marker.get("keys", {}), state)
        _check_bound(run_url, state, marker.get("run"), options)
        return state
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep to parse
        raise CorruptDataError(f"checkpoint {folder} does not verify: {exc}") from None


def _check_bound(run_url: str, state: CheckpointState, written_by: Any, options: StorageOptions | None) -> None:
    """An encrypted checkpoint's data keys are bound to the run that wrote them (its COMMITTED names
    it, signed with the rest): one copied in from another run is not this run's, and is skipped as
    a corrupt one is, instead of stopping a resume when its keys do not unwrap here."""
    if not state.keys or written_by is None:  # plaintext, or written before COMMITTED named its run
        return
    here = run_id(run_url, options)
    if written_by != here:
        raise ValueError(f"its files are bound to run {written_by!r}, not this run {here!r} (copied from another run?)")


def _sealed_files(keys: Any, state: CheckpointState) -> dict[str, dict[str, Any]]:
    """COMMITTED's wrapped data keys, one per file of the checkpoint, or none (not encrypted)."""
    if not isinstance(keys, dict) or not all(isinstance(v, dict) for v in keys.values()):
        raise ValueError(f"{COMMITTED}: keys is not an object of encryption records")
    if keys and set(keys) != set(state.files):
        raise ValueError(f"{COMMITTED}: keys names {sorted(keys)}, not the checkpoint's files {sorted(state.files)}")
    return keys


def verify_checkpoint(run_url: str, step: int, options: StorageOptions | None = None) -> CheckpointState:
    """state.json of a committed checkpoint whose every file is present at its recorded size;
    CorruptDataError otherwise.

    The files' contents are checked against their checksums by whoever reads them
    (`read_rank_tensors`), in the same pass that loads them: verifying here would read the
    whole checkpoint once more, on one rank."""
    state = read_state(run_url, step, options)
    folder = step_dir(run_url, step)
    for name, info in state.files.items():
        url = join(folder, name)
        fs, path = resolve(url, options)
        try:
            size = retrying(f"stat {url}", functools.partial(fs.size, path))
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
) -> CheckpointState | None:
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
    run_url: str, state: CheckpointState, rank: int, options: StorageOptions | None = None
) -> dict[str, torch.Tensor]:
    """The tensors rank `rank` saved in a committed checkpoint; CorruptDataError unless the file
    matches the size and checksum state.json recorded (and, for a signed checkpoint, its SHA-256;
    for an encrypted one, every chunk authenticates with its data key).

    One streamed pass: the bytes are read straight into the tensors and checksummed on the
    way, so a multi-GB rank file is never held in memory besides the tensors it holds."""
    name = rank_file(rank)
    info = state.files.get(name)
    if info is None:
        return {}
    folder = step_dir(run_url, state.step)
    url = join(folder, name)
    fs, path = resolve(url, options)
    sealed = state.keys.get(name)
    context = file_context(run_url, state.step, name, options) if sealed is not None else ""
    key = _data_key(folder, sealed, context, options) if sealed is not None else None

    def attempt() -> dict[str, torch.Tensor]:
        with fs.open(path, "rb") as raw:
            handle = HashingReader(raw, sha256=SHA256 in info)
            size = int(info["bytes"])
            if key is not None:
                opened = SealReader(handle, size, key, context)
                tensors = read_safetensors(opened, opened.size)
            else:
                tensors = read_safetensors(handle, size)
            handle.check(info, url)
            return tensors

    try:
        return retrying(f"read {url}", attempt)
    except (OSError, ValueError) as exc:
        raise CorruptDataError(f"checkpoint {folder} does not verify: {name}: {exc}") from None


def file_context(run_url: str, step: int, name: str, options: StorageOptions | None) -> str:
    """What a checkpoint file's data key and chunks are bound to: the run, the step, the file."""
    return f"run {run_id(run_url, options)}/checkpoints/step-{step:08d}/{name}"


def _data_key(folder: str, sealed: Any, context: str, options: StorageOptions | None) -> bytes:
    keys = encryption_keys(options)
    if keys is None:
        raise CorruptDataError(
            f"checkpoint {folder} is encrypted; set storage.encryption.key to the keyring it was written with"
        )
    return data_key(keys, sealed, context)


class HashingReader:
    """A file handle that checksums (xxh3, and SHA-256 when asked) every byte read through it."""

    def __init__(self, handle: Any, *, sha256: bool):
        self._handle = handle
        self._xxh3 = new_digest()
        self._sha = hashlib.sha256() if sha256 else None

    def readinto(self, buffer: Any) -> int:
        n = self._handle.readinto(buffer)
        if n:
            view = memoryview(buffer).cast("B")[:n]
            self._xxh3.update(view)
            if self._sha is not None:
                self._sha.update(view)
        return n

    def read(self, n: int = -1) -> bytes:
        data = self._handle.read(n)
        self._xxh3.update(data)
        if self._sha is not None:
            self._sha.update(data)
        return data

    def check(self, info: dict[str, Any], url: str) -> None:
        """ValueError unless what was read matches the record's checksum (and SHA-256); the reader of
        the format on top (`read_safetensors`, `SealReader`) has already checked nothing follows."""
        verify_digest(self._xxh3, info["checksum"])
        if self._sha is not None and self._sha.hexdigest() != info.get(SHA256):
            raise ValueError("its SHA-256 does not match the signed record")


_MAX_HEADER = 100 << 20
_CHUNK = 64 << 20


def read_safetensors(handle: Any, size: int) -> dict[str, torch.Tensor]:
    """Parse a safetensors file of `size` bytes from `handle` into new CPU tensors.

    The header is validated before anything is allocated: the tensors must tile the data
    section exactly (as the format requires), which must end where the recorded size does."""
    head = _read_exact(handle, bytearray(8))
    header_len = int.from_bytes(head, "little")
    if not 2 <= header_len <= min(_MAX_HEADER, size - 8):
        raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
    header = json.loads(_read_exact(handle, bytearray(header_len)))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    entries = []
    for name, entry in header.items():
        try:
            dtype, shape = DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]]
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
            _read_exact(handle, tensor.reshape(-1).view(torch.uint8).numpy())
        tensors[name] = tensor
    if handle.read(1):
        raise ValueError(f"longer than the {size} bytes recorded")
    return tensors


def _read_exact(handle: Any, buffer: Any) -> Any:
    """Fill the writable `buffer` from `handle`; returns it."""
    view = memoryview(buffer).cast("B")
    filled = 0
    while filled < len(view):
        n = handle.readinto(view[filled : filled + _CHUNK])
        if not n:
            raise ValueError(f"truncated: {len(view) - filled} bytes missing")
        filled += n
    return buffer


# The files petatrain writes in a checkpoint's folder (a `.tmp-` sibling: a write cut short).
_OWN_FILE = re.compile(r"(COMMITTED|state\.json|rank-\d{5,}\.safetensors)(\.tmp-[0-9a-f]{12})?")


def remove_checkpoint(run_url: str, step: int, options: StorageOptions | None = None) -> bool:
    """Delete the files petatrain wrote in the folder of a committed checkpoint, COMMITTED first
    (a deletion cut short leaves a torn checkpoint, never a committed one missing files); False,
    with nothing deleted, if its record does not check out (it may not be petatrain's).

    Files petatrain does not write stay, and so does their folder."""
    folder = step_dir(run_url, step)
    if is_local(folder) and os.path.islink(resolve(folder)[1]):
        return False  # deleting through it would delete what it points to
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
            retrying(f"remove {folder}/{name}", functools.partial(fs.rm_file, f"{path.rstrip('/')}/{name}"))
    if is_local(folder) and len(ours) == len(entries):
        with contextlib.suppress(OSError):  # a file written there meanwhile: the folder stays
            os.rmdir(path)
    return True
