"""The format registry: the one place that knows the input formats.

`REGISTRY` maps a format's name (`--format`, `ingest.format`) to its `Format`: the reader that
parses a file of it (one module per format in this package), the file name suffixes that mean it
(`detect_format`, looking through a compression suffix) and whether the splitter may cut a large
file of it at its line breaks (`SPLITTABLE`). A new format is a module with a `read` function
and one line in `_TABLE`.

`read_file` and `read_piece` dispatch on the name. A compressed file is decompressed first
(`decompress`), in chunks up to `MAX_DECOMPRESSED_BYTES` or a share of the memory this worker has
left (its container's, else the host's), so a small bomb never expands whole and a file too large
for a small pod is one quarantine record instead of a worker killed for memory again and again.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
from fsspec.compression import compr
from fsspec.utils import infer_compression

from petatrain.data.readers import csv, jsonl, parquet, text, tfrecord, webdataset
from petatrain.data.readers.base import (
    MAX_EXPANDED_BYTES,
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


_TABLE = (
    Format("jsonl", jsonl.read, (".jsonl", ".ndjson", ".json"), splittable=True),
    Format("parquet", parquet.read, (".parquet", ".pq")),
    Format("csv", csv.read, (".csv", ".tsv"), splittable=True),
    Format("text", text.read, (".txt", ".text", ".md"), splittable=True),
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
