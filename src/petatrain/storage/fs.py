"""URL -> fsspec filesystem, atomic publication, verified reads."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import io
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.core import split_protocol

from petatrain.errors import PetatrainError, StorageAccessError
from petatrain.security.protection import Protection
from petatrain.storage.checksum import checksum_bytes, verify
from petatrain.storage.retry import retrying
from petatrain.storage.sse import ServerSideEncryption

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class StorageOptions:
    """How to reach object stores. Empty fields fall back to the usual AWS_* variables."""

    s3_endpoint_url: str = ""
    s3_region: str = ""
    s3_access_key_id: str = field(default="", repr=False)  # never shown: reprs reach logs and errors
    s3_secret_access_key: str = field(default="", repr=False)
    s3_anonymous: bool = False
    ca_bundle: str = ""  # PEM file of the CAs that may issue the S3 endpoint's certificate ("" = the system's)
    sse: ServerSideEncryption = field(default_factory=ServerSideEncryption)
    # The data is meant to be encrypted (server-side encryption, or petatrain's own encryption):
    # then S3 is reached over TLS only, unless allow_http says a plain-HTTP endpoint is fine.
    encrypted: bool = False
    allow_http: bool = False
    # The SSE-C key itself, read from sse.customer_key by for_workers() so that workers on other
    # nodes need no copy of the variable or file; never in a repr or a config.
    sse_customer_key: bytes = field(default=b"", repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # passed to fsspec as is; may hold secrets
    # What protects the data (`storage.encryption`, `storage.signing`): where the keys are, not keys.
    protection: Protection = field(default_factory=Protection)

    def __hash__(self) -> int:  # extra is a dict; options are compared, not mutated
        identity = (self.s3_endpoint_url, self.s3_region, self.s3_access_key_id, self.s3_anonymous)
        return hash((*identity, self.ca_bundle, self.sse, self.encrypted, self.allow_http, self.protection))

    @property
    def require_tls(self) -> bool:
        """True when a plain-HTTP S3 endpoint must be refused: the data is encrypted (server-side, or
        by petatrain with `storage.encryption.key`) and `allow_http` was not given."""
        return (self.encrypted or bool(self.protection.encryption_key) or self.sse.enabled) and not self.allow_http

    def for_workers(self) -> StorageOptions:
        """These options with the driver's AWS_* endpoint and credentials filled in.

        Ray workers on other nodes (and workers started before the variables were set)
        do not share the driver's environment, so a job carries what the driver sees.
        """
        env = os.environ
        key = self.s3_access_key_id or env.get("AWS_ACCESS_KEY_ID", "")
        customer_key = self.sse_customer_key
        if self.sse.mode == "customer" and not customer_key:
            from petatrain.storage.sse import read_customer_key

            customer_key = read_customer_key(self.sse.customer_key)
        return dataclasses.replace(
            self,
            protection=self.protection.for_workers(),
            s3_endpoint_url=self.s3_endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL", ""),
            s3_access_key_id=key,
            s3_secret_access_key=self.s3_secret_access_key or (env.get("AWS_SECRET_ACCESS_KEY", "") if key else ""),
            ca_bundle=self.ca_bundle or env.get("AWS_CA_BUNDLE", ""),
            sse_customer_key=customer_key,
        )

    def without_secrets(self) -> StorageOptions:
        """These options less every credential (S3 keys, the SSE-C key, a key service's token,
        `extra`): what may be written where these options must not be, e.g. a pickled state on disk.
        `for_workers()` on the result fills the credentials in again from a process's environment."""
        return dataclasses.replace(
            self, s3_access_key_id="", s3_secret_access_key="", sse_customer_key=b"", extra={},
            protection=self.protection.without_secrets(),
        )  # fmt: skip

    def fsspec_kwargs(self, protocol: str) -> dict[str, Any]:
        if protocol not in ("s3", "s3a"):
            return dict(self.extra)
        endpoint = (
            self.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
        )
        if endpoint.lower().startswith("http://") and self.require_tls:
            why = f"storage.sse.mode is {self.sse.mode}" if self.sse.enabled else "the data is encrypted"
            raise PetatrainError(
                f"refusing the plain-HTTP S3 endpoint {endpoint}: {why}, so S3 is reached over TLS only; "
                "use an https:// endpoint (storage.s3_endpoint_url), or set storage.allow_http: true"
            )
        # AWS_REGION / AWS_DEFAULT_REGION are read by botocore itself; passing them on as
        # region_name would also make s3fs send a LocationConstraint when creating buckets,
        # which us-east-1 and S3-compatible stores reject.
        region = self.s3_region
        kwargs: dict[str, Any] = {"anon": self.s3_anonymous}
        client: dict[str, Any] = {}
        if endpoint:
            client["endpoint_url"] = endpoint
        if region:
            client["region_name"] = region
        if self.ca_bundle:
            client["verify"] = checked_ca_bundle(self.ca_bundle)
        if client:
            kwargs["client_kwargs"] = client
        if self.s3_access_key_id:
            kwargs["key"] = self.s3_access_key_id
            kwargs["secret"] = self.s3_secret_access_key
        kwargs.update(self.extra)
        encryption = self.sse.request_kwargs(self.sse_customer_key)
        if encryption:
            kwargs["s3_additional_kwargs"] = {**kwargs.get("s3_additional_kwargs", {}), **encryption}
        return kwargs

    def trusts_unsigned(self, dataset: str) -> bool:
        """Whether the dataset at `dataset` is one `storage.signing.unsigned` lets be read unsigned."""
        return canonical_url(dataset) in {canonical_url(u) for u in self.protection.unsigned_datasets}


def canonical_url(url: str) -> str:
    """`url` as two names of one place compare equal: a local path absolute, no trailing slash."""
    return os.path.abspath(os.path.expanduser(url)) if is_local(url) else url.rstrip("/")


def checked_ca_bundle(path: str) -> str:
    """`path` made absolute, once it is known to be a readable PEM file with a certificate."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise PetatrainError(f"storage.ca_bundle {path}: {exc.strerror} (a PEM file of CA certificates)") from None
    return _pem_bundle(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _pem_bundle(path: str, mtime_ns: int, size: int) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except OSError as exc:
        raise PetatrainError(f"storage.ca_bundle {path}: {exc.strerror} (a PEM file of CA certificates)") from None
    if b"-----BEGIN CERTIFICATE-----" not in text:
        raise PetatrainError(f"storage.ca_bundle {path}: not a PEM file of CA certificates (no BEGIN CERTIFICATE)")
    return path


DEFAULT_OPTIONS = StorageOptions()


def resolve(url: str, options: StorageOptions | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and in-filesystem path for a URL or plain path."""
    protocol, path = split_protocol(url)
    protocol = protocol or "file"
    options = options or DEFAULT_OPTIONS
    try:
        kwargs = options.fsspec_kwargs(protocol)
        if protocol in ("s3", "s3a"):
            from petatrain.storage._s3fs import S3FileSystem

            fs = S3FileSystem(**kwargs)
        else:
            fs = fsspec.filesystem(protocol, **kwargs)
    except (ImportError, ValueError) as exc:
        raise PetatrainError(f"cannot open {url!r}: no filesystem for '{protocol}://' ({exc})") from None
    if protocol == "file":
        path = os.path.abspath(os.path.expanduser(path))
    return fs, fs._strip_protocol(path) if protocol != "file" else path


def is_local(url: str) -> bool:
    return (split_protocol(url)[0] or "file") == "file"


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def to_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Inverse of `resolve` for paths listed by `fs` (keeps the scheme of remote stores)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def numbered(url: str, prefix: str, options: StorageOptions | None = None) -> list[int]:
    """The numbers of the files `PREFIXNNNNNNNN.json` directly in the folder `url`, ascending ([] when
    the folder does not exist): a dataset's versions, a commit log, a model's versions and events."""
    fs, path = resolve(url, options)
    try:
        names = retrying(f"list {url}", lambda: fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
    pattern = re.compile(re.escape(prefix) + r"(\d{8})\.json")
    found = (pattern.fullmatch(str(name).rsplit("/", 1)[-1]) for name in names)
    return sorted(int(m[1]) for m in found if m)


def exists(url: str, options: StorageOptions | None = None) -> bool:
    fs, path = resolve(url, options)
    return retrying(f"exists {url}", lambda: fs.exists(path))


def listdir(url: str, options: StorageOptions | None = None) -> list[str]:
    """URLs of the files directly or indirectly under `url`, sorted; [] if it does not exist."""
    fs, path = resolve(url, options)
    try:
        found = retrying(f"list {url}", lambda: fs.find(path))
    except FileNotFoundError:
        return []
    return sorted(to_url(fs, p) for p in found)


def read_bytes(url: str, options: StorageOptions | None = None) -> bytes:
    fs, path = resolve(url, options)
    return retrying(f"read {url}", lambda: fs.cat_file(path))


def read_range(url: str, start: int, end: int, options: StorageOptions | None = None) -> bytes:
    """Bytes [start, end) of a file: a ranged read, so a worker holds only its part of a large file."""
    fs, path = resolve(url, options)
    return retrying(f"read {url} [{start}, {end})", lambda: fs.cat_file(path, start=start, end=end))


class RangeReader(io.RawIOBase):
    """A file of `size` bytes (its listed size) read front to back in ranged reads of `block` bytes,
    each retried as `read_range` is: a stream that never holds the file (a compressed source
    decompressed as it is read). Each range read is given to `seen`, if any (a checksum). A file
    that ends before `size`, or goes on past it, raises `changed(how)`'s message."""

    def __init__(
        self,
        url: str,
        size: int,
        options: StorageOptions | None = None,
        *,
        changed: Callable[[str], str],
        seen: Callable[[bytes], None] | None = None,
        block: int = 1 << 20,
    ):
        super().__init__()
        self.url, self.size, self.options, self.block = url, size, options, block
        self._changed, self._seen, self._pos, self._ended = changed, seen, 0, False
        self.failed = False  # a read of the file failed: the stream's error is the source's, not its bytes'

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            return self._readinto(buffer)
        except BaseException:
            self.failed = True
            raise

    def _readinto(self, buffer: Any) -> int:
        if self._pos >= self.size:
            if not self._ended:
                fs, path = resolve(self.url, self.options)
                now = retrying(f"size of {self.url}", lambda: fs.size(path))
                if now != self.size:
                    raise PetatrainError(self._changed(f"it is {now} bytes, {self.size} when it was listed"))
            self._ended = True
            return 0
        end = min(self._pos + min(len(buffer), self.block), self.size)
        data = read_range(self.url, self._pos, end, self.options)
        if len(data) != end - self._pos:
            raise PetatrainError(self._changed(f"it ended at byte {self._pos + len(data)} of {self.size}"))
        buffer[: len(data)] = data
        self._pos = end
        if self._seen is not None:
            self._seen(data)
        return len(data)


def read_verified(url: str, checksum: str, options: StorageOptions | None = None) -> bytes:
    """Read a file petatrain wrote and check it against its recorded checksum."""
    data = read_bytes(url, options)
    verify(data, checksum, url)
    return data


# What makes a local folder petatrain's: a run's marker (train/run_dir.py), a dataset's index folder
# (data/index.py). Inside such a folder nothing is written or deleted through a symbolic link.
OWNED_MARKERS = (".petatrain-run", "_index")


def _owned(folder: str) -> bool:
    return any(os.path.lexists(os.path.join(folder, marker)) for marker in OWNED_MARKERS)


def refuse_links(path: str, *, itself: bool = False) -> None:
    """Refuse (PetatrainError, one line) a local path that reaches through a symbolic link inside a
    run or dataset folder: `final/` linked to another run's, a checkpoint folder linked to another
    run's checkpoint, `data/` or `_index/` linked elsewhere. A link above the run or dataset (the
    folder the user named may itself be one) is the user's and is followed. `itself`: the last
    component counts too (a folder about to be deleted, a file appended to)."""
    path = os.path.abspath(path)
    current = path if itself else os.path.dirname(path)
    while True:
        if os.path.islink(current):
            owner = next((a for a in _ancestors(current) if _owned(a)), None)
            if owner is not None:
                raise PetatrainError(
                    f"refusing to write {path}: {os.path.relpath(current, owner)} in {owner} is a symbolic link "
                    f"(to {os.readlink(current)}); petatrain never writes or deletes through a link inside a run "
                    "or dataset: remove the link"
                )
            return
        if _owned(current):
            return
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def refuse_linked_entries(url: str, *, descend: tuple[str, ...] = ()) -> None:
    """Before a writer starts in a local run or dataset folder: refuse (one line) a folder whose
    entries, or those of its sub-folders named in `descend` (and theirs), include a symbolic link,
    instead of finding it at the first write or, worse, at retention's first delete."""
    if not is_local(url):
        return
    root = resolve(url)[1]
    pending = [root]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            relative = os.path.relpath(entry.path, root)
            if entry.is_symlink():
                raise PetatrainError(
                    f"{url}: {relative} is a symbolic link (to {os.readlink(entry.path)}); petatrain never writes "
                    "or deletes through a link inside a run or dataset: remove the link"
                )
            if entry.is_dir(follow_symlinks=False) and relative.split(os.sep)[0] in descend:
                pending.append(entry.path)


def _ancestors(path: str) -> list[str]:
    out, current = [], os.path.dirname(path)
    while True:
        out.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            return out
        current = parent


def atomic_write(url: str, data: bytes, options: StorageOptions | None = None) -> tuple[str, int]:
    """Write `data` so that `url` is either absent or complete; returns (checksum, size).

    Local disk: write a temporary sibling, fsync, read back and verify, then rename over
    the final name. Object stores: a single PUT (or a multipart upload, which becomes
    visible only when completed) is already all-or-nothing; the stored size is checked.
    """
    checksum = checksum_bytes(data)
    fs, path = resolve(url, options)
    if is_local(url):
        refuse_links(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            with open(tmp, "rb") as handle:
                verify(handle.read(), checksum, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return checksum, len(data)

    retrying(f"write {url}", lambda: fs.pipe_file(path, data))
    _check_stored(fs, path, url, len(data), options)
    return checksum, len(data)


def _check_stored(fs: Any, path: str, url: str, size: int, options: StorageOptions | None) -> None:
    """After an upload: the object has the size written and, if SSE is configured, is encrypted so."""
    fs.invalidate_cache(path)
    sse = (options or DEFAULT_OPTIONS).sse
    if sse.enabled:
        bucket, key, _ = fs.split_path(path)
        head = retrying(f"stat {url}", lambda: fs.call_s3("head_object", Bucket=bucket, Key=key))
        stored = head["ContentLength"]
        try:
            sse.check_stored(head, url)
        except PetatrainError:
            with contextlib.suppress(Exception):  # not left readable in a form it was not meant to have
                fs.rm_file(path)
            raise
    else:
        stored = retrying(f"stat {url}", lambda: fs.info(path)["size"])
    if stored != size:
        raise OSError(f"{url}: stored {stored} bytes, wrote {size}")


def local_staging_path(url: str) -> str:
    """Where to stage a file before `publish_file(url, ...)`: beside it on local disk (so the
    publication is a rename), in the temp directory for an object store."""
    if is_local(url):
        _, path = resolve(url)
        refuse_links(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    import tempfile

    fd, name = tempfile.mkstemp(prefix="petatrain-stage-")
    os.close(fd)
    return name


def publish_file(
    url: str, staged: str, options: StorageOptions | None = None, *, consume: bool = True
) -> tuple[str, int]:
    """Publish a staged local file at `url`, all or nothing, like `atomic_write`; returns (checksum, size).

    The checksum is computed by reading the staged file back in chunks after fsync, so a
    multi-GB checkpoint is never held in memory. The staged file is consumed (on local disk
    it becomes `url`); with `consume=False` an upload leaves it for the caller to retry or remove.
    """
    from petatrain.storage.checksum import checksum_file

    try:
        with open(staged, "rb+") as handle:
            os.fsync(handle.fileno())
        checksum, size = checksum_file(staged), os.path.getsize(staged)
        fs, path = resolve(url, options)
        if is_local(url):
            refuse_links(path)  # a link made since the file was staged
            os.replace(staged, path)
            return checksum, size
        retrying(f"upload {url}", lambda: fs.put_file(staged, path))
        _check_stored(fs, path, url, size, options)
        return checksum, size
    finally:
        if consume and os.path.exists(staged):
            os.unlink(staged)


def remove_tree(url: str, options: StorageOptions | None = None) -> None:
    """Remove a folder and everything under it; a missing folder is fine.

    On an object store the folder is listed again afterwards: a multi-object delete answers
    per object, and s3fs drops those answers, so an object the store refused to delete (a
    policy without s3:DeleteObject there) would otherwise stay without a word.
    """
    fs, path = resolve(url, options)
    if is_local(url):
        refuse_links(path, itself=True)
    with contextlib.suppress(FileNotFoundError):
        retrying(f"remove {url}", lambda: fs.rm(path, recursive=True))
    if not is_local(url):
        fs.invalidate_cache(path)
        left = retrying(f"list {url}", lambda: fs.find(path))
        if left:
            raise StorageAccessError(
                f"remove {url}: {len(left)} object(s) still there after the delete, e.g. {to_url(fs, left[0])} "
                "(did the store refuse them? the identity may need s3:DeleteObject there)"
            )


def copy(src: str, dst: str, options: StorageOptions | None = None) -> None:
    """Server-side copy within one filesystem (atomic at the destination on object stores).

    A store that cannot copy encrypted objects (Ceph RGW before Reef answers NotImplemented)
    gets the bytes read and written again through this process instead, encrypted the same way.
    """
    fs, src_path = resolve(src, options)
    _, dst_path = resolve(dst, options)
    if is_local(dst):
        refuse_links(dst_path)
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        tmp = f"{dst_path}.tmp-{uuid.uuid4().hex[:12]}"
        fs.copy(src_path, tmp)
        os.replace(tmp, dst_path)
        return
    try:
        retrying(f"copy {src} -> {dst}", lambda: fs.copy(src_path, dst_path))
    except OSError as exc:
        if exc.errno != errno.ENOSYS or not (options or DEFAULT_OPTIONS).sse.enabled:
            raise
        _warn_copy_fallback(src)
        retrying(f"copy {src} -> {dst}", lambda: _copy_through_client(fs, src_path, dst_path))
    if (options or DEFAULT_OPTIONS).sse.enabled:
        _check_stored(fs, dst_path, dst, retrying(f"stat {src}", lambda: fs.size(src_path)), options)


def _copy_through_client(fs: Any, src_path: str, dst_path: str) -> None:
    # A multipart upload, completed only once every byte is in (autocommit off: closing the
    # file does not complete it): the copy is still all or nothing at the destination.
    with fs.open(src_path, "rb") as source:
        target = fs.open(dst_path, "wb", autocommit=False)
        try:
            shutil.copyfileobj(source, target, 8 * 2**20)
            target.close()
            target.commit()
        except BaseException:
            target.discard()
            raise


_warned_copy_fallback = False


def _warn_copy_fallback(example: str) -> None:
    global _warned_copy_fallback
    if not _warned_copy_fallback:  # once per process
        _warned_copy_fallback = True
        log.warning(
            "the object store cannot copy encrypted objects server-side (%s); copying through this process "
            "instead (Ceph RGW before Reef does not implement it)",
            example,
        )


@dataclass(slots=True, frozen=True)
class SourceFile:
    """One input file: its URL, size and a cheap identity (ETag or mtime) to spot changes."""

    url: str
    size: int
    fingerprint: str
    root: str = ""  # the folder (or a glob's fixed leading folder) it was found under: Hive partitions below it


def unchanged(source: SourceFile, options: StorageOptions | None = None) -> bool:
    """Whether a listed source file still has the size and identity (ETag, mtime) it was listed with."""
    fs, path = resolve(source.url, options)
    fs.invalidate_cache(path)
    try:
        info = retrying(f"stat {source.url}", functools.partial(fs.info, path))
    except FileNotFoundError:
        return False
    return int(info.get("size") or 0) == source.size and _fingerprint(info) == source.fingerprint


def _fingerprint(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return f"{key}:{str(info[key]).strip(chr(34))}"
    return ""


def _forget_listings(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop the listings cached under `path` (up to a glob's first wildcard): file system objects
    are shared in a process, and a listing cached earlier must not hide files written since (a
    folder Spark rewrote, then `--register --refresh`); s3fs trusts a cached parent listing."""
    prefix = path[: min(path.find(ch) % (len(path) + 1) for ch in "*?[")].rstrip("/")
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        for key in [k for k in list(cache) if k == prefix or k.startswith(prefix + "/")]:
            cache.pop(key, None)
    fs.invalidate_cache(prefix)


def expand_sources(
    patterns: list[str], options: StorageOptions | None = None, *, allow_empty: bool = False
) -> list[SourceFile]:
    """Expand paths, folders and globs into files, in argument order then sorted by name.

    A pattern that names an existing file or folder is taken as written, so `data[1].jsonl`
    is that file and never `data1.jsonl`. A pattern that matches nothing is an error naming
    it: a typo must not ingest nothing (`allow_empty`: an existing folder with no file yet, or a
    glob matching none, is [], as a watcher of a folder files land in needs).
    """
    files: list[SourceFile] = []
    seen: set[str] = set()
    for pattern in patterns:
        fs, path = resolve(pattern, options)
        _forget_listings(fs, path)
        try:
            try:
                info = retrying(f"stat {pattern}", functools.partial(fs.info, path))
            except Exception:
                if not any(ch in path for ch in "*?["):
                    raise
                info = None  # not a path as written: a glob
            if info is None:
                infos = retrying(f"glob {pattern}", functools.partial(fs.glob, path, detail=True))
                root = path[: min(path.find(ch) % (len(path) + 1) for ch in "*?[")].rpartition("/")[0]
            elif info["type"] == "directory":
                infos = retrying(f"list {pattern}", functools.partial(fs.find, path, detail=True))
                root = path.rstrip("/")
            else:
                infos = {path: info}
                root = path.rpartition("/")[0]
        except FileNotFoundError:
            if allow_empty and not is_local(pattern):  # an object-store prefix exists once a file is under it
                continue
            raise PetatrainError(f"source not found: {pattern}") from None
        except PermissionError as exc:
            raise PetatrainError(f"source not readable: {pattern} ({exc})") from None
        except PetatrainError:
            raise
        except Exception as exc:
            raise PetatrainError(f"cannot read source {pattern}: {type(exc).__name__}: {exc}") from None
        matched = [
            (p, i)
            for p, i in sorted(infos.items())
            if i.get("type") != "directory" and not os.path.basename(p).startswith((".", "_"))
        ]
        if not matched and not allow_empty:
            raise PetatrainError(f"source matched no files: {pattern}")
        for p, info in matched:
            url = to_url(fs, p)
            if url not in seen:
                seen.add(url)
                files.append(
                    SourceFile(
                        url=url,
                        size=int(info.get("size") or 0),
                        fingerprint=_fingerprint(info),
                        root=to_url(fs, root) + "/",
                    )
                )
    return files
