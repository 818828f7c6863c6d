"""One way to reach any URL: plain paths, file://, s3:// and whatever fsspec offers.

Everything petatrain writes goes through `atomic_write`, is checksummed, and is verified
on read by `read_verified`. Transient object-store errors are retried with backoff.
"""

from petatrain.storage.checksum import ChecksumMismatch, checksum_bytes
from petatrain.storage.fs import (
    StorageOptions,
    atomic_write,
    exists,
    expand_sources,
    join,
    listdir,
    read_bytes,
    read_verified,
    remove_tree,
    resolve,
)
from petatrain.storage.retry import retrying

__all__ = [
    "ChecksumMismatch",
    "StorageOptions",
    "atomic_write",
    "checksum_bytes",
    "exists",
    "expand_sources",
    "join",
    "listdir",
    "read_bytes",
    "read_verified",
    "remove_tree",
    "resolve",
    "retrying",
]
