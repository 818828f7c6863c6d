"""Sealed files: AES-256-GCM in chunks, for checkpoints and final weights (`cryptography`'s AESGCM).

Layout, format version 1:

    header   b"PTSEAL" 0x00 0x01 | chunk size (u32, little-endian): 12 bytes
    chunks   AES-256-GCM(plaintext[i*C:(i+1)*C]) || 16-byte tag, for i = 0..n-1 (n >= 1;
             the last chunk may be shorter, and is empty only when the whole file is)

Rules that make it safe to use, written down (STYLE: no format without them):
- **Key**: every file gets a fresh random 256-bit data key (`new_data_key`); only its wrapped
  form is stored, in the file's record (a checkpoint's state.json, the final weights' COMMITTED),
  wrapped for the same context as below. A data key never encrypts two files.
- **Nonce**: chunk i uses the 96-bit nonce 0x00000000 || i (u64, big-endian). Unique per key,
  because a key seals one file, once.
- **Associated data** of chunk i: "petatrain-seal/1", the context (what the file is: the run's
  id, the step, the file's name), the header, i, and a last-chunk flag. So a chunk moved within
  the file, a file cut short at a chunk boundary or extended, a header changed, or a file swapped
  for another one (another step's, another run's) fails authentication instead of decrypting.
"""

from __future__ import annotations

import io
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from petatrain.errors import CorruptDataError
from petatrain.security.keys import KmsClient

MAGIC = b"PTSEAL\x00\x01"
HEADER = len(MAGIC) + 4
TAG = 16
CHUNK = 4 << 20  # large enough that per-chunk costs vanish, small enough to stream
ALGORITHM = "aes-256-gcm-chunked/1"
_AAD = b"petatrain-seal/1\0"


def new_data_key(keys: KmsClient, context: str) -> tuple[bytes, dict[str, Any]]:
    """A fresh data key and the record that stores it wrapped: {"algorithm", "key", "key_version"}."""
    key = AESGCM.generate_key(bit_length=256)
    return key, {"algorithm": ALGORITHM, "key": keys.wrap(key, context), "key_version": keys.primary}


def data_key(keys: KmsClient, record: Any, context: str) -> bytes:
    """The data key a record stores for `context` (KeyringError if it does not unwrap)."""
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM or not isinstance(record.get("key"), str):
        raise CorruptDataError(f"{context}: its encryption record is not one this petatrain reads ({ALGORITHM})")
    return keys.unwrap(record["key"], context)


def rewrap(keys: KmsClient, record: dict[str, Any], context: str) -> dict[str, Any]:
    """The record with its data key wrapped by the keyring's primary version (the data unchanged)."""
    return {**record, "key": keys.wrap(data_key(keys, record, context), context), "key_version": keys.primary}


def sealed_size(plain: int, chunk: int = CHUNK) -> int:
    chunks = max(1, -(-plain // chunk))
    return HEADER + plain + chunks * TAG


def plain_size(sealed: int, chunk: int) -> int:
    """The plaintext size of a sealed file of `sealed` bytes; ValueError if no plaintext has that size."""
    body = sealed - HEADER
    chunks = max(1, -(-body // (chunk + TAG)))
    plain = body - chunks * TAG
    if plain < 0 or sealed_size(plain, chunk) != sealed:
        raise ValueError(f"{sealed} bytes is not the size of a sealed file with {chunk}-byte chunks")
    return plain


def _aad(context: bytes, header: bytes, index: int, last: bool) -> bytes:
    return b"".join((_AAD, context, b"\0", header, struct.pack(">QB", index, last)))


def _nonce(index: int) -> bytes:
    return b"\0\0\0\0" + struct.pack(">Q", index)


class SealWriter:
    """Encrypts what is written to it into `sink`, chunk by chunk; `close()` seals the last chunk."""

    def __init__(self, sink: Any, key: bytes, context: str, *, chunk: int = CHUNK):
        self._sink, self._aead, self._context, self._chunk = sink, AESGCM(key), context.encode(), chunk
        self._header = MAGIC + struct.pack("<I", chunk)
        self._buffer = bytearray()
        self._index = 0
        sink.write(self._header)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        if self._buffer:  # top up the pending chunk first; it is sealed once more data follows it
            need = self._chunk - len(self._buffer)
            if len(view) <= need:
                self._buffer += view
                return written
            self._buffer += view[:need]
            view = view[need:]
            self._emit(self._buffer, last=False)
            self._buffer = bytearray()
        while len(view) > self._chunk:  # whole chunks straight from the caller's memory
            self._emit(view[: self._chunk], last=False)
            view = view[self._chunk :]
        self._buffer += view  # the tail: it may yet be the last chunk
        return written

    def _emit(self, plain: Any, *, last: bool) -> None:
        aad = _aad(self._context, self._header, self._index, last)
        self._sink.write(self._aead.encrypt(_nonce(self._index), plain, aad))
        self._index += 1

    def close(self) -> None:
        """Seal the last chunk (the file is incomplete, and will not open, until this is called)."""
        if len(self._buffer) > self._chunk:  # cannot happen: write() keeps at most one chunk
            raise AssertionError("sealed writer buffered more than one chunk")
        self._emit(self._buffer, last=True)
        self._buffer = bytearray()


class SealReader:
    """Reads the plaintext of a sealed file of `size` bytes from `handle`, authenticating each chunk
    before returning any of its bytes; ValueError (naming nothing secret) when a chunk fails."""

    def __init__(self, handle: Any, size: int, key: bytes, context: str):
        header = handle.read(HEADER)
        if len(header) != HEADER or header[: len(MAGIC)] != MAGIC:
            raise ValueError("not a sealed file of format 1 (its header is wrong or the file is not encrypted)")
        (chunk,) = struct.unpack("<I", header[len(MAGIC) :])
        if not 1 <= chunk <= 1 << 30:
            raise ValueError(f"sealed file header names a chunk size of {chunk} bytes")
        self.size = plain_size(size, chunk)
        self._handle, self._aead, self._context, self._header, self._chunk = (
            handle,
            AESGCM(key),
            context.encode(),
            header,
            chunk,
        )
        self._chunks = max(1, -(-self.size // chunk))
        self._index = 0
        self._plain = memoryview(b"")

    def _next(self) -> bool:
        if self._index >= self._chunks:
            return False
        last = self._index == self._chunks - 1
        want = (self.size - self._index * self._chunk if last else self._chunk) + TAG
        sealed = bytearray()
        while len(sealed) < want:
            block = self._handle.read(want - len(sealed))
            if not block:
                raise ValueError(f"sealed file truncated in chunk {self._index}")
            sealed += block
        try:
            plain = self._aead.decrypt(
                _nonce(self._index), sealed, _aad(self._context, self._header, self._index, last)
            )
        except InvalidTag:
            raise ValueError(
                f"chunk {self._index} does not authenticate (the file was changed, cut, reordered, or "
                "belongs to another checkpoint)"
            ) from None
        self._index += 1
        self._plain = memoryview(plain)
        if last and self._handle.read(1):
            raise ValueError("sealed file is longer than its record says")
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not self._plain and not self._next():
            return 0
        n = min(len(view), len(self._plain))
        view[:n] = self._plain[:n]
        self._plain = self._plain[n:]
        return n

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if not self._plain and not self._next():
                break
            take = len(self._plain) if n < 0 else min(n - len(out), len(self._plain))
            out += self._plain[:take]
            self._plain = self._plain[take:]
        return bytes(out)


def seal_bytes(data: bytes, key: bytes, context: str, *, chunk: int = CHUNK) -> bytes:
    sink = io.BytesIO()
    writer = SealWriter(sink, key, context, chunk=chunk)
    writer.write(data)
    writer.close()
    return sink.getvalue()


def open_bytes(blob: bytes, key: bytes, context: str) -> bytes:
    return SealReader(io.BytesIO(blob), len(blob), key, context).read()
