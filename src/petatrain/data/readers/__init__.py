"""Readers for raw input files, one module per format (`jsonl`, `parquet`, `csv`, `text`, `webdataset`,
`tfrecord`), each a `read(data, text_field, max_bytes, out)` that fills a `FileRecords` with records
and one-line rejects; `base` holds what they share (`FileRecords`, `FieldChoice`, field typing, the
line and JSON helpers) and `registry` the one table that maps a format's name and file suffixes to its
reader, with `detect_format`, `decompress`, the `read_file`/`read_piece` dispatch and `read_stream` (a
compressed file of lines, decompressed as it is read). Ingest reads
through this package; the loader never does. The names below are the package's public surface.
"""

from petatrain.data.readers.base import (
    RAW_PREFIX_BYTES,
    FieldChoice,
    FileRecords,
    Reject,
    json_text,
    record_byte_cap,
    typed_array,
    value_kinds,
)
from petatrain.data.readers.csv import csv_rows_are_lines
from petatrain.data.readers.registry import (
    FORMATS,
    REGISTRY,
    SPLITTABLE,
    Format,
    decompress,
    detect_format,
    read_file,
    read_piece,
    read_stream,
    streamed,
)
from petatrain.data.readers.tfrecord import masked_crc32c

__all__ = [
    "FORMATS",
    "RAW_PREFIX_BYTES",
    "REGISTRY",
    "SPLITTABLE",
    "FieldChoice",
    "FileRecords",
    "Format",
    "Reject",
    "csv_rows_are_lines",
    "decompress",
    "detect_format",
    "json_text",
    "masked_crc32c",
    "read_file",
    "read_piece",
    "read_stream",
    "record_byte_cap",
    "streamed",
    "typed_array",
    "value_kinds",
]
