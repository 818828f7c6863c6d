"""Node-local shard cache: each shard crosses the network about once per node.

Ranks and DataLoader workers on one node share the cache folder. A shard is fetched
under an exclusive file lock (so one process downloads it while the others wait),
verified against its recorded checksum, and published by rename. Least recently used
shards are evicted to stay under the byte limit; readers hold shards memory-mapped, so
an evicted file stays readable to them (POSIX unlink semantics) and is never re-read
half-gone.
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
from pathlib import Path

import pyarrow as pa

from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage import StorageOptions, read_bytes
from petatrain.storage.checksum import checksum_bytes
from petatrain.storage.fs import is_local, resolve

log = logging.getLogger(__name__)


def default_cache_dir(dataset_url: str) -> str:
    root = os.environ.get("PETATRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "petatrain"
    )
    return os.path.join(root, hashlib.sha256(dataset_url.encode()).hexdigest()[:16])


class ShardCache:
    """Local paths of verified shards. Local datasets are read in place (verified once per process)."""

    def __init__(self, cache_dir: str | None, *, limit_bytes: int | None, options: StorageOptions | None):
        self.dir = Path(cache_dir) if cache_dir else None
        self.limit = limit_bytes
        self.options = options
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)

    def open(self, url: str, checksum: str, size: int) -> pa.MemoryMappedFile:
        """The shard's verified bytes, memory-mapped; fetched first if needed.

        The file is opened before the cache lock is released (or, for a hit, opened
        directly), so a concurrent eviction can only unlink it, never pull it from
        under a reader.
        """
        if self.dir is None and is_local(url):
            _, path = resolve(url)
            with self._lock:
                done = path in self._verified
            if done:
                return pa.memory_map(path)
            mapped = self._verify_local(url, path, checksum)
            with self._lock:
                self._verified.add(path)
            return mapped
        if self.dir is None:
            raise PetatrainError(f"{url} is remote: the loader needs a cache_dir")
        target = self.dir / self._name(url)
        with contextlib.suppress(FileNotFoundError):
            handle = pa.memory_map(str(target))
            os.utime(target)  # recency for LRU eviction
            return handle
        with open(self.dir / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not target.exists():  # else another process fetched it while we waited
                    self._make_room(size)
                    self._fetch(url, checksum, target)
                os.utime(target)
                return pa.memory_map(str(target))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _name(url: str) -> str:
        return hashlib.sha256(url.encode()).hexdigest()[:24] + ".parquet"

    def _verify_local(self, url: str, path: str, checksum: str) -> pa.MemoryMappedFile:
        """Map the file and hash it in place; the same mapping is handed to the reader, so
        the pages the hash faulted in are not faulted in again (no read() copy either)."""
        try:
            mapped = pa.memory_map(path)
        except FileNotFoundError:
            raise CorruptDataError(f"shard missing: {url}") from None
        actual = checksum_bytes(memoryview(mapped.read_buffer()))
        if actual != checksum:
            raise CorruptDataError(f"shard corrupt: {url} (checksum {actual} != recorded {checksum})")
        mapped.seek(0)
        return mapped

    def _fetch(self, url: str, checksum: str, target: Path) -> None:
        started = time.perf_counter()
        try:
            data = read_bytes(url, self.options)
        except FileNotFoundError:
            raise CorruptDataError(f"shard missing: {url}") from None
        actual = checksum_bytes(data)
        if actual != checksum:
            raise CorruptDataError(f"shard corrupt: {url} (checksum {actual} != recorded {checksum})")
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        log.debug("fetched %s (%d bytes) in %.2fs", url, len(data), time.perf_counter() - started)

    def _make_room(self, size: int) -> None:
        if self.limit is None:
            return
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.dir.glob("*.parquet")]
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total + size <= self.limit:
                break
            p.unlink(missing_ok=True)
            total -= s
        if total + size > self.limit:
            raise PetatrainError(f"cache_limit {self.limit} bytes cannot hold a {size}-byte shard; raise cache_limit")
