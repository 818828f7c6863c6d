"""JSON Lines: one JSON object a line, the text in field `text_field`; blank lines separate records."""

from __future__ import annotations

from petatrain.data.readers.base import FileRecords, capped_lines, parse_json, take_field


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    for number, raw in capped_lines(data, max_bytes, out):
        if not raw.strip():
            continue  # blank lines separate records; they are not records
        parsed, value = parse_json(number, raw, out)
        if parsed:
            take_field(number, value, text_field, raw, out)
