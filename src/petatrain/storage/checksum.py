"""Checksums of everything petatrain writes: xxh3-128, written as 'xxh3-128:<hex>'."""

from __future__ import annotations

from typing import Any

import xxhash

ALGORITHM = "xxh3-128"


class ChecksumMismatch(ValueError):
    """Bytes read back do not match the checksum recorded when they were written."""


def checksum_bytes(data: bytes | memoryview) -> str:
    return f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


def verify(data: bytes | memoryview, expected: str, where: str) -> None:
    _compare(checksum_bytes(data), expected, where)


def new_digest() -> xxhash.xxh3_128:
    """A running checksum for bytes that arrive in pieces; finish with `checksum_of` or `verify_digest`."""
    return xxhash.xxh3_128()


def checksum_of(digest: xxhash.xxh3_128) -> str:
    return f"{ALGORITHM}:{digest.hexdigest()}"


def verify_digest(digest: xxhash.xxh3_128, expected: str, where: str = "") -> None:
    _compare(checksum_of(digest), expected, where)


def _compare(actual: str, expected: str, where: str) -> None:
    if actual != expected:
        prefix = f"{where}: " if where else ""
        raise ChecksumMismatch(f"{prefix}checksum {actual} does not match recorded {expected}")


def checksum_file(path: str) -> str:
    """Checksum of a local file, read in chunks (large checkpoints never sit in memory twice)."""
    return checksum_of(hash_file(path, new_digest()))


def hash_file(path: str, digest: Any, chunk: int = 8 << 20) -> Any:
    """`digest` (any hashlib-like object) updated with a local file's bytes, read in chunks."""
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest
