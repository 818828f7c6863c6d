"""Checksums of everything petatrain writes: xxh3-128, written as 'xxh3-128:<hex>'."""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3-128"


class ChecksumMismatch(ValueError):
    """Bytes read back do not match the checksum recorded when they were written."""


def checksum_bytes(data: bytes | memoryview) -> str:
    return f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


def verify(data: bytes | memoryview, expected: str, where: str) -> None:
    actual = checksum_bytes(data)
    if actual != expected:
        raise ChecksumMismatch(f"{where}: checksum {actual} does not match recorded {expected}")


def checksum_file(path: str, chunk: int = 8 << 20) -> str:
    """Checksum of a local file, read in chunks (large checkpoints never sit in memory twice)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return f"{ALGORITHM}:{digest.hexdigest()}"
