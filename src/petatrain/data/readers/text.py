"""Plain text: every non-empty line is a record."""

from __future__ import annotations

from petatrain.data.readers.base import FileRecords, capped_lines, decode_utf8


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    for number, raw in capped_lines(data, max_bytes, out):
        if not raw:
            continue
        line = decode_utf8(number, raw, out)
        if line is not None:
            out.keep(number, line)
