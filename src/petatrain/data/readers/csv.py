"""CSV, read by Arrow under a header row: a row is a record, the text in column `text_field`.

A malformed row (a wrong number of fields, a quoted field that never closes) is rejected and
the rows around it kept. `csv_rows_are_lines` tells the splitter whether a CSV may be cut at its
line breaks.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.csv as pacsv

from petatrain.data.buffers import arrow_reader
from petatrain.data.readers.base import FileRecords, column_records


def csv_rows_are_lines(data: bytes | memoryview) -> bool:
    """Whether every non-empty line of a CSV is one row: no quote (a quoted field may hold a line
    break) and no bare carriage return (Arrow ends a row there too)."""
    raw = bytes(data) if isinstance(data, memoryview) else data
    return b'"' not in raw and raw.count(b"\r") == raw.count(b"\r\n")


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    bad: list[str] = []

    def on_invalid(row) -> str:
        bad.append(row.text or "")
        return "skip"

    # Arrow lets a quoted field that never closes swallow every row after it, silently:
    # read only the rows before it, and reject the rows from it to the end.
    unclosed = _unclosed_quote_row(data)
    if unclosed == 0:
        raise ValueError("the header row opens a quoted field that never closes")
    table = pacsv.read_csv(
        arrow_reader(data if unclosed is None else memoryview(data)[:unclosed]),
        parse_options=pacsv.ParseOptions(invalid_row_handler=on_invalid, newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types={text_field: pa.string()}, strings_can_be_null=False),
    )
    # Arrow does not say where a skipped row was. Where rows are lines they are numbered in place
    # (so a split file numbers them as the whole file does); else after the read ones.
    placed = _csv_row_numbers(data, table.num_rows, len(bad)) if bad else None
    good, bad_numbers = placed if placed else (None, range(table.num_rows, table.num_rows + len(bad)))
    column_records(table, text_field, out, 0, good)
    for number, text in zip(bad_numbers, bad, strict=True):
        out.reject(number, "malformed_csv_row", "wrong number of fields", text.encode("utf-8", "replace"))
    number = table.num_rows + len(bad)
    if unclosed is not None:
        line_number = data.count(b"\n", 0, unclosed) + 1
        detail = f"the row on line {line_number} opens a quoted field that never closes"
        for line in data[unclosed:].splitlines():
            if line:
                out.reject(number, "malformed_csv_row", detail, line)
                number += 1


def _csv_row_numbers(data: bytes, rows: int, bad: int) -> tuple[list[int], list[int]] | None:
    """(numbers of the rows Arrow read, numbers of those it skipped as malformed) for a CSV whose
    rows are its non-empty lines; None for any other, or if the lines do not add up to Arrow's rows."""
    if not csv_rows_are_lines(data):
        return None
    lines = [line for line in data.split(b"\n") if line and line != b"\r"]
    if not lines:
        return None
    width = lines[0].count(b",")  # without quotes a comma always separates two fields
    good: list[int] = []
    skipped: list[int] = []
    for number, line in enumerate(lines[1:]):
        (good if line.count(b",") == width else skipped).append(number)
    return (good, skipped) if len(good) == rows and len(skipped) == bad else None


# A CSV file as Arrow reads it (its default delimiter and quote, which `read` uses),
# token by token: a quote opens a field only at the field's start, and a quoted field
# that never closes is where the match stops. Possessive, so it runs in linear time.
_CSV_TOKENS = re.compile(
    rb"""(?:
        [^",\r\n][^,\r\n]*+                  # an unquoted field: a quote inside it is a literal
      | "[^"]*+(?:""[^"]*+)*+"[^,\r\n]*+     # a quoted field that closes, and what follows it
      | ,
      | [\r\n]()                             # a line break: a row starts after it
    )*+""",
    re.VERBOSE,
)


def _unclosed_quote_row(data: bytes) -> int | None:
    """Where the row starts whose quoted field runs to the end of the file, or None."""
    if b'"' not in data:
        return None
    tokens = _CSV_TOKENS.match(data)
    assert tokens is not None  # the pattern matches the empty string, so it matches every file
    return None if tokens.end() == len(data) else max(tokens.start(1), 0)
