"""The format registry: the one place that knows the input formats.

`REGISTRY` maps a format's name (`--format`, `ingest.format`) to its `Format`: the reader that
parses a file of it (one module per format in this package), the file name suffixes that mean it
(`detect_format`, looking through a compression suffix) and whether the splitter may cut a large
file of it at its line breaks (`SPLITTABLE`). A new format is a module with a `read` function
and one line in `_TABLE`.

`read_file` and `read_piece` dispatch on the name. A compressed file of line records (JSONL, text:
`streamed`) is decompressed as it is read (`read_stream`): its records come in pieces of about a
chunk, cut at line ends and numbered as in the whole file, so a worker holds one piece, not the
file, and a line over the record cap is rejected as it streams past. Another compressed file is
decompressed first (`decompress`), in chunks up to `MAX_DECOMPRESSED_BYTES` or a share of the
memory this worker has left (its container's, else the host's), so a small bomb never expands
whole and a file too large for a small pod is one quarantine record instead of a worker killed for
memory again and again. A stream stops at `MAX_DECOMPRESSED_BYTES` in all (a bomb).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pyarrow as pa
from fsspec.compression import compr
from fsspec.utils import infer_compression

from petatrain.data.readers import csv, jsonl, parquet, text, tfrecord, webdataset
from petatrain.data.readers.base import (
    MAX_EXPANDED_BYTES,
    RAW_PREFIX_BYTES,
    FieldChoice,
    FileRecords,
    expansion_limit,
    record_byte_cap,
    too_large,
)
from petatrain.errors import PetatrainError
from petatrain.host import memory_left

MAX_DECOMPRESSED_BYTES = MAX_EXPANDED_BYTES  # per file: past it a compressed source is unreadable_file
_DECOMPRESS_CHUNK = 1 << 20


# A reader: (a file's decompressed bytes, the text field, the record byte cap, the records to fill).
Read = Callable[[bytes, str, int, FileRecords], None]


@dataclass(frozen=True, slots=True)
class Format:
    """One input format: its name, its reader, its file name suffixes, and whether its records are
    lines (so `ingest/split.py` may cut a large uncompressed file of it at newlines)."""

    name: str
    read: Read
    extensions: tuple[str, ...]
    splittable: bool = False
    lines: bool = False  # a record is a line: a compressed file of it is read as a stream (`read_stream`)


_TABLE = (
    Format("jsonl", jsonl.read, (".jsonl", ".ndjson", ".json"), splittable=True, lines=True),
    Format("parquet", parquet.read, (".parquet", ".pq")),
    Format("csv", csv.read, (".csv", ".tsv"), splittable=True),
    Format("text", text.read, (".txt", ".text", ".md"), splittable=True, lines=True),
    Format("webdataset", webdataset.read, (".tar",)),
    Format("tfrecord", tfrecord.read, (".tfrecord", ".tfrecords")),
)
REGISTRY: dict[str, Format] = {f.name: f for f in _TABLE}
FORMATS = tuple(REGISTRY)
SPLITTABLE = tuple(f.name for f in _TABLE if f.splittable)
_EXTENSIONS = {ext: f.name for f in _TABLE for ext in f.extensions}


def detect_format(url: str) -> str:
    """Format from the file name, looking through a compression suffix."""
    name = url.lower()
    compression = infer_compression(name)
    if compression:
        name = os.path.splitext(name)[0]
    ext = os.path.splitext(name)[1]
    if ext not in _EXTENSIONS:
        raise PetatrainError(f"cannot tell the format of {url} from its name; pass --format ({'|'.join(FORMATS)})")
    return _EXTENSIONS[ext]


def decompress(url: str, data: bytes) -> bytes:
    """`data` decompressed as `url`'s suffix says, in chunks: past `MAX_DECOMPRESSED_BYTES`
    it stops and raises, so a small bomb never expands whole."""
    compression = infer_compression(url.lower())
    if not compression:
        return data
    left = memory_left()
    limit = expansion_limit(MAX_DECOMPRESSED_BYTES, left)
    out = io.BytesIO()
    with compr[compression](io.BytesIO(data), mode="rb") as handle:
        while chunk := handle.read(min(_DECOMPRESS_CHUNK, limit + 1 - out.tell())):
            out.write(chunk)
            if out.tell() > limit:
                raise too_large(
                    MAX_DECOMPRESSED_BYTES, left, "when decompressed", "split the file before compressing it"
                )
    return out.getvalue()


def streamed(url: str, fmt: str) -> bool:
    """Whether `url` is read as a stream (`read_stream`): a compressed file of line records."""
    if not infer_compression(url.lower()):
        return False
    try:
        fmt = detect_format(url) if fmt == "auto" else fmt
    except PetatrainError:
        return False
    return fmt in REGISTRY and REGISTRY[fmt].lines


def read_stream(
    url: str,
    raw: BinaryIO,
    fmt: str,
    text_field: str,
    *,
    max_chars: int,
    piece_bytes: int,
    fields: FieldChoice | None = None,
) -> Iterator[FileRecords]:
    """The records of `raw`, a compressed file of line records (`streamed`), decompressed as it is
    read: one `FileRecords` per piece of about `piece_bytes` (at most a share of the worker's memory)
    cut at a line end, its records and rejects numbered as in the whole file; at least one. A line
    over the record cap is rejected `too_long` as it streams past, never held. Raises past
    `MAX_DECOMPRESSED_BYTES` decompressed in all, and on a stream that does not decompress."""
    cap = record_byte_cap(max_chars)
    # A piece holds at least one whole record; the worker holds one piece and what it parses into.
    limit = max(min(piece_bytes, expansion_limit(MAX_DECOMPRESSED_BYTES, memory_left())), cap + 2)
    buffer, total, first, open_len, yielded, skipped = bytearray(), 0, 0, 0, False, FileRecords()
    # A line over the cap streaming past: [its number, its first bytes, its length so far, its last byte].
    long_line: list[Any] | None = None

    def piece(cut: int) -> FileRecords:
        nonlocal first, yielded
        data = bytes(buffer[:cut])
        del buffer[:cut]
        records = read_piece(url, data, fmt, text_field, max_chars=max_chars, first_record=first, fields=fields)
        records.rejects += skipped.rejects
        skipped.rejects = []
        first += data.count(b"\n")
        yielded = True
        return records

    with compr[infer_compression(url.lower())](raw, mode="rb") as handle:
        while True:
            chunk = handle.read(_DECOMPRESS_CHUNK)
            ended = not chunk
            total += len(chunk)
            if total > MAX_DECOMPRESSED_BYTES:
                raise too_large(MAX_DECOMPRESSED_BYTES, None, "when decompressed", "")
            if long_line is not None:  # skip to its end
                end = chunk.find(b"\n")
                long_line[2] += len(chunk) if end < 0 else end
                long_line[3] = chunk[end - 1 : end] if end > 0 else chunk[-1:] if end < 0 and chunk else long_line[3]
                if end < 0 and not ended:
                    continue
                number, prefix, length, last = long_line
                length -= last == b"\r"  # its line ending is CRLF: not counted, as capped_lines does not
                detail = f"over the {cap}-byte cap that max_chars sets; raw is {length} bytes, the first {len(prefix)}"
                skipped.reject(number, "too_long", detail + " kept", prefix)  # as FileRecords.reject says it
                long_line = None
                if end >= 0:
                    first, chunk = first + 1, chunk[end + 1 :]
            buffer += chunk
            end = chunk.rfind(b"\n")
            open_len = len(chunk) - end - 1 if end >= 0 else open_len + len(chunk)  # the line being read
            if open_len > cap + 1:  # over the cap, even less a CR: what is before it is a piece; it streams past
                start = len(buffer) - open_len
                if start:
                    yield piece(start)
                long_line = [first, bytes(buffer[:RAW_PREFIX_BYTES]), open_len, buffer[-1:]]
                buffer.clear()
                open_len = 0
                continue
            if len(buffer) >= limit or (ended and (buffer or not yielded)):
                yield piece(len(buffer) if ended else len(buffer) - open_len)
            if ended:
                if skipped.rejects:  # the file ended inside a line over the cap
                    yield skipped
                return


def read_file(
    url: str, data: bytes, fmt: str, text_field: str, *, max_chars: int, fields: FieldChoice | None = None
) -> FileRecords:
    """Parse one file's (decompressed) bytes into records and rejects; with `fields`, the
    records' other fields too (`FileRecords.fields_table`)."""
    out = FileRecords(choice=None if fields is None or fields.none else fields)
    reader = REGISTRY[fmt].read
    try:
        reader(data, text_field, record_byte_cap(max_chars), out)
    except Exception as exc:  # the file as a whole is unreadable: quarantine it, keep going
        out.reject(len(out.index) + len(out.rejects), "unreadable_file", f"{type(exc).__name__}: {exc}"[:500])
        if out.tables:  # row-aligned tables must end where the kept records do (a torn Parquet file)
            out.tables = [pa.concat_tables(out.tables).slice(0, len(out.index))]
    return out


def read_piece(
    url: str,
    data: bytes,
    fmt: str,
    text_field: str,
    *,
    max_chars: int,
    first_record: int,
    header: bytes = b"",
    fields: FieldChoice | None = None,
) -> FileRecords:
    """Parse one piece of a split file: `data` is a byte range that starts and ends at record
    boundaries, whose first record is record `first_record` of the file; a CSV piece after the
    first is read under the file's `header` row. Records and rejects are numbered as in the whole
    file, so a file reads the same however it is split (its fields' types are the whole file's:
    see `FileRecords.field_texts`)."""
    out = read_file(url, header + data if header else data, fmt, text_field, max_chars=max_chars, fields=fields)
    if first_record:
        out.index = [first_record + i for i in out.index]
        for reject in out.rejects:
            reject.index += first_record
    return out
