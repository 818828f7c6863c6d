"""Node-local shard cache: each shard crosses the network about once per node.

Ranks and DataLoader workers on one node share the cache folder. Entries are named by the
shard's checksum from the dataset's index, not by its URL, so a dataset replaced at the same
URL can never be served from the old one's entries. A shard is fetched under an exclusive
file lock (so one process downloads it while the others wait), verified, and published by
rename; every open maps the file and verifies it again (the hash faults in the pages the
reader then uses), and an entry that no longer matches, because its bytes were changed on
disk, is dropped and fetched again. Least recently used shards are evicted to stay under the
byte limit (each entry's last use is the time of a `.used` file beside it); readers hold
shards memory-mapped, so an evicted file stays readable to them (POSIX unlink semantics) and
is never re-read half-gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa

from petatrain import constants
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.security.signing import sha256_hex
from petatrain.storage import StorageOptions, read_bytes
from petatrain.storage.checksum import ALGORITHM, checksum_bytes
from petatrain.storage.fs import is_local, resolve

log = logging.getLogger(__name__)


# Files this process hashed and found matching, by path, expected digests and what `stat` says of
# them (inode, size, mtime, ctime): a file rewritten since has another stat and is hashed again. So
# each shard is hashed once per process, not once per epoch (SHA-256 of a signed dataset's shards
# cost as much as decrypting them).
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 1 << 16  # a bound: a process reading millions of shards re-hashes the oldest ones


class _Verified:
    """The set of verified file keys, least recently used ones dropped past `_VERIFIED_MAX`."""

    def __init__(self) -> None:
        self._keys: OrderedDict[tuple, None] = OrderedDict()

    def __contains__(self, key: tuple) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def add(self, key: tuple) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > _VERIFIED_MAX:
            self._keys.popitem(last=False)


_VERIFIED = _Verified()


def _stat_key(path: Path | str, checksum: str, sha256: str) -> tuple:
    stat = os.stat(path)
    return (str(path), checksum, sha256, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _used(entry: Path) -> Path:
    """The file beside a cache entry whose modification time is the entry's last use (LRU eviction)."""
    return entry.with_name(entry.name + ".used")


def _touch_used(entry: Path) -> None:
    _used(entry).touch()


def _last_used(entry: Path) -> float:
    """When the entry was last used: its `.used` file's time, else (an entry of an older cache) its own."""
    try:
        return _used(entry).stat().st_mtime
    except FileNotFoundError:
        return entry.stat().st_mtime


def default_cache_dir(dataset_url: str) -> str:
    root = os.environ.get(constants.CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "petatrain"
    )
    return os.path.join(root, hashlib.sha256(dataset_url.encode()).hexdigest()[:16])


class ShardCache:
    """Local paths of verified shards. Local datasets are read in place (verified once per process)."""

    def __init__(self, cache_dir: str | None, *, limit_bytes: int | None, options: StorageOptions | None):
        self.dir = Path(cache_dir) if cache_dir else None
        self.limit = limit_bytes
        self.options = options
        self._lock = threading.Lock()
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)

    def open(self, url: str, checksum: str, size: int, sha256: str = "") -> pa.MemoryMappedFile:
        """The shard's verified bytes, memory-mapped; fetched first if needed.

        The file is opened before the cache lock is released (or, for a hit, opened
        directly), so a concurrent eviction can only unlink it, never pull it from
        under a reader. `sha256` (a signed dataset's) is checked wherever the checksum is.
        """
        if self.dir is None and is_local(url):
            # Read in place; hashed again whenever the file is not the one this process verified.
            _, path = resolve(url)
            try:
                mapped = pa.memory_map(path)
                key = _stat_key(path, checksum, sha256)
            except FileNotFoundError:
                raise CorruptDataError(f"shard missing: {url}") from None
            with _VERIFIED_LOCK:
                done = key in _VERIFIED
            if not done:
                self._verify_local(url, mapped, checksum, sha256)
                with _VERIFIED_LOCK:
                    _VERIFIED.add(key)
            return mapped
        if self.dir is None:
            raise PetatrainError(f"{url} is remote: the loader needs a cache_dir")
        target = self.dir / self._name(url, checksum)
        with contextlib.suppress(FileNotFoundError):
            handle = self._cached(target, checksum, sha256)
            if handle is not None:
                return handle
        with open(self.dir / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                # fetched while we waited?
                handle = self._cached(target, checksum, sha256) if target.exists() else None
                if handle is None:
                    self._make_room(size)
                    self._fetch(url, checksum, sha256, target)
                    _touch_used(target)
                    handle = pa.memory_map(str(target))  # verified by _fetch before it was published
                return handle
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _name(url: str, checksum: str) -> str:
        """The entry's file name: the shard's content checksum (checked, since the index names it)."""
        algorithm, _, digest = checksum.partition(":")
        if algorithm != ALGORITHM or len(digest) != 32 or digest.strip("0123456789abcdef"):
            raise CorruptDataError(f"the shard index lists {url} with a malformed checksum {checksum!r}")
        return f"{digest}.parquet"

    def _cached(self, target: Path, checksum: str, sha256: str) -> pa.MemoryMappedFile | None:
        """The entry, mapped and verified; None (and the entry dropped) if its bytes changed on disk.

        What is remembered as verified is the file's stat from before its bytes were hashed, and only if
        it is still the file's stat after: a write while it was hashed counts as a change. The entry's
        recency goes on a file beside it (`_touch_used`), never on the entry itself, whose stat then
        changes only when its bytes do. (Setting the entry's own times after the hash, as before, gave
        a write between the hash and the new stat a verified stat: a flipped bit served.)"""
        mapped = pa.memory_map(str(target))
        key = _stat_key(target, checksum, sha256)
        with _VERIFIED_LOCK:
            done = key in _VERIFIED
        if not done:
            data = memoryview(mapped.read_buffer())
            matches = checksum_bytes(data) == checksum and not (sha256 and sha256_hex(data) != sha256)
            if not matches or _stat_key(target, checksum, sha256) != key:
                log.warning("cached shard %s changed on disk; fetching it again", target)
                mapped.close()
                self._drop(target)
                return None
            with _VERIFIED_LOCK:
                _VERIFIED.add(key)
        mapped.seek(0)
        _touch_used(target)
        return mapped

    @staticmethod
    def _drop(target: Path) -> None:
        target.unlink(missing_ok=True)
        _used(target).unlink(missing_ok=True)

    @staticmethod
    def _verify_local(url: str, mapped: pa.MemoryMappedFile, checksum: str, sha256: str) -> None:
        """Hash the mapping in place; the reader gets the same mapping, so the pages the hash
        faulted in are not faulted in again (no read() copy either)."""
        data = memoryview(mapped.read_buffer())
        actual = checksum_bytes(data)
        if actual != checksum:
            raise CorruptDataError(f"shard corrupt: {url} (checksum {actual} != recorded {checksum})")
        if sha256 and sha256_hex(data) != sha256:
            raise CorruptDataError(f"shard {url} does not match the SHA-256 of the signed dataset index")
        mapped.seek(0)

    def _fetch(self, url: str, checksum: str, sha256: str, target: Path) -> None:
        started = time.perf_counter()
        try:
            data = read_bytes(url, self.options)
        except FileNotFoundError:
            raise CorruptDataError(f"shard missing: {url}") from None
        actual = checksum_bytes(data)
        if actual != checksum:
            raise CorruptDataError(f"shard corrupt: {url} (checksum {actual} != recorded {checksum})")
        if sha256 and sha256_hex(data) != sha256:
            raise CorruptDataError(f"shard {url} does not match the SHA-256 of the signed dataset index")
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        log.debug("fetched %s (%d bytes) in %.2fs", url, len(data), time.perf_counter() - started)

    def _make_room(self, size: int) -> None:
        if self.limit is None or self.dir is None:
            return
        files = [(_last_used(p), p.stat().st_size, p) for p in self.dir.glob("*.parquet")]
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total + size <= self.limit:
                break
            self._drop(p)
            total -= s
        if total + size > self.limit:
            raise PetatrainError(f"cache_limit {self.limit} bytes cannot hold a {size}-byte shard; raise cache_limit")
