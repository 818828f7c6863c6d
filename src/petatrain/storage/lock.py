"""A lease on a dataset or run folder: one writer at a time, on a local disk and on S3.

The lease is one small JSON object (`owner`, `host`, `pid`, `since`, `expires`) created
only if absent: `O_EXCL` semantics on a local disk (a complete temporary file hard-linked
to the final name, so a reader never sees it half-written), `If-None-Match: *` on S3
(honoured by AWS S3 and by Ceph's RADOS Gateway). The holder renews it in a background
thread; a holder that died stops renewing, and once its lease has expired (at once when it
ran on this host and its process is gone) the next writer takes the folder over. Taking over
is itself a create-if-absent (a `.break-OWNER` marker), so of two writers that find the same
expired lease only one removes it.

Before it publishes anything that makes its work visible (a manifest, a checkpoint commit),
the holder calls `check()`: if its lease was lost (it stalled past `ttl_s` and another
writer took over), it stops with an error instead of overwriting the other writer's work.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from petatrain.errors import PetatrainError
from petatrain.storage.fs import StorageOptions, is_local, refuse_links, resolve
from petatrain.storage.retry import retrying

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0
LEASE_FILE = "_lock"  # the name a folder's lease has in it (a dataset, a run)


class LeaseHeld(PetatrainError):
    """Another live writer holds the folder."""


class LeaseLost(PetatrainError):
    """This writer's lease expired and was taken over; it must not publish."""


@dataclass(slots=True, frozen=True)
class LeaseRecord:
    owner: str  # a fresh id per holder
    kind: str  # what holds it: "ingest", "train"
    host: str
    pid: int
    since: float
    expires: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{self.kind} pid {self.pid} on {self.host}, since {started}"

    def died_here(self) -> bool:
        """The holder ran on this host and its process is gone: it can renew nothing, so its lease
        need not be waited out. Elsewhere (another pod, another machine) only expiry tells."""
        if self.host != socket.gethostname() or self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return _zombie(self.pid)


def _zombie(pid: int) -> bool:
    """`pid` has exited and only waits to be reaped (a killed holder whose parent left without waiting,
    in a container whose first process reaps nothing): it answers signals but renews nothing."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class _Exists(Exception):
    """Create-if-absent found the object already there."""


class Lease:
    """`with Lease(url, kind="ingest") as lease:` holds `url` exclusively until the block ends."""

    def __init__(
        self,
        url: str,
        *,
        kind: str,
        what: str = "",
        options: StorageOptions | None = None,
        ttl_s: float = DEFAULT_TTL_S,
    ):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.url, self.kind, self.options, self.ttl_s = url, kind, options, ttl_s
        self.what = what or url.rsplit("/", 1)[0]
        self.owner = uuid.uuid4().hex
        self._fs, self._path = resolve(url, options)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str = ""
        self._since = time.time()

    # -- the lease's lifetime ----------------------------------------------------------------
    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lease, or raise `LeaseHeld` naming the live holder. With `wait_s`, a held lease is
        waited for that long first: one whose holder died (it stopped renewing) expires within `ttl_s`,
        while a live holder keeps renewing and is still refused."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._acquire_once()
            except LeaseHeld as held:
                if time.monotonic() >= deadline:
                    raise
                log.warning("%s; waiting up to %.0f s", held, deadline - time.monotonic())
                time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))

    def _acquire_once(self) -> None:
        self._since = time.time()
        for _ in range(3):  # a takeover race lost to a third writer is retried a couple of times
            try:
                self._create(self.url, self._record())
            except _Exists:
                held = self._read()
                if held is None:
                    continue  # released between our create and our read
                if held.expires > time.time() and not held.died_here():
                    raise LeaseHeld(
                        f"{self.what} is in use by another {held.describe()}; wait for it to finish "
                        f"(if it died, its lease expires in {max(0.0, held.expires - time.time()):.0f} s)"
                    ) from None
                self._take_over(held)
                continue
            self._thread = threading.Thread(target=self._renew, name="petatrain-lease", daemon=True)
            self._thread.start()
            return
        raise LeaseHeld(f"{self.what} is being taken over by another writer; try again")

    def check(self) -> None:
        """Raise `LeaseLost` unless this writer still holds the lease (call before publishing)."""
        if self._lost:
            raise LeaseLost(self._lost)
        held = self._read()
        if held is None or held.owner != self.owner:
            self._lost = (
                f"lost the lease on {self.what}: "
                + ("it was removed" if held is None else f"now held by {held.describe()}")
                + "; nothing was published"
            )
            raise LeaseLost(self._lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        held = self._read()
        if held is not None and held.owner == self.owner:
            self._remove(self.url)

    # -- internals ---------------------------------------------------------------------------
    def _record(self) -> LeaseRecord:
        now = time.time()
        return LeaseRecord(
            owner=self.owner,
            kind=self.kind,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=self._since,
            expires=now + self.ttl_s,
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                held = self._read()
                if held is None or held.owner != self.owner:
                    self._lost = f"lost the lease on {self.what} (renewal found it gone or taken over)"
                    log.error("%s", self._lost)
                    return
                self._put(self.url, json.dumps(asdict(self._record())).encode())
            except Exception as exc:  # a renewal that fails is retried at the next tick; expiry decides
                log.warning("could not renew the lease on %s: %s", self.what, exc)

    def _take_over(self, stale: LeaseRecord) -> None:
        """Remove an expired lease; only the writer that creates the break marker does it."""
        marker = f"{self.url}.break-{stale.owner}"
        try:
            self._create(marker, self._record())
        except _Exists:
            time.sleep(0.2)  # another writer is taking over; our next create decides
            return
        try:
            current = self._read()
            if current is not None and current.owner == stale.owner:
                why = "whose holder's process is gone" if stale.died_here() else "that expired"
                log.warning("taking over %s from a lease %s (%s)", self.what, why, stale.describe())
                self._remove(self.url)
        finally:
            self._remove(marker)

    def _read(self) -> LeaseRecord | None:
        try:
            data = retrying(f"read {self.url}", lambda: self._fs.cat_file(self._path))
        except FileNotFoundError:
            return None
        try:
            fields: dict[str, Any] = json.loads(data)
            return LeaseRecord(**fields)
        except (ValueError, TypeError):
            # Unreadable: a foreign or damaged file. Treat it as held for one more TTL from
            # now, never as free, so a bug cannot turn into two writers.
            return LeaseRecord(
                owner="?", kind="unknown writer", host="?", pid=0, since=0.0, expires=time.time() + self.ttl_s
            )

    def _create(self, url: str, record: LeaseRecord) -> None:
        data = json.dumps(asdict(record)).encode()
        fs, path = resolve(url, self.options)
        if is_local(url):
            refuse_links(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)  # fails if `path` exists: the local create-if-absent
            except FileExistsError:
                raise _Exists from None
            finally:
                os.unlink(tmp)
            return
        try:
            retrying(f"create {url}", lambda: fs.pipe_file(path, data, mode="create"))
        except Exception as exc:
            if _precondition_failed(exc):
                raise _Exists from None
            raise
        fs.invalidate_cache(path)

    def _put(self, url: str, data: bytes) -> None:
        fs, path = resolve(url, self.options)
        if is_local(url):
            refuse_links(path)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            with open(tmp, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
            return
        retrying(f"write {url}", lambda: fs.pipe_file(path, data))
        fs.invalidate_cache(path)

    def _remove(self, url: str) -> None:
        fs, path = resolve(url, self.options)
        with contextlib.suppress(FileNotFoundError):
            retrying(f"remove {url}", lambda: fs.rm_file(path))
        fs.invalidate_cache(path)


def _precondition_failed(exc: BaseException) -> bool:
    """True for S3's 412 on a create-if-absent (s3fs reports it as a bare OSError)."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return True
        seen = seen.__cause__ or seen.__context__
    return False
