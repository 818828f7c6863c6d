"""Checksums of everything petatrain writes: xxh3-128, written as 'xxh3-128:<hex>'."""

from __future__ import annotations

from typing import BinaryIO

import xxhash

ALGORITHM = "xxh3-128"
_READ_CHUNK = 8 << 20


class ChecksumMismatch(ValueError):
    """Bytes read back do not match the checksum recorded when they were written."""


def checksum_bytes(data: bytes | memoryview) -> str:
    return f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


def checksum_file(handle: BinaryIO) -> tuple[str, int]:
    """Checksum and size of an open binary stream, read in chunks."""
    digest = xxhash.xxh3_128()
    size = 0
    while chunk := handle.read(_READ_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return f"{ALGORITHM}:{digest.hexdigest()}", size


def verify(data: bytes | memoryview, expected: str, where: str) -> None:
    actual = checksum_bytes(data)
    if actual != expected:
        raise ChecksumMismatch(f"{where}: checksum {actual} does not match recorded {expected}")
