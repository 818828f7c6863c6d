"""What every reader shares: the records one file reads into, and the record-level parsing.

Each reader turns one file's bytes into records `(index, text)` and rejects
`(index, reason, detail, raw)` in a `FileRecords`; a malformed record becomes a reject and
the file goes on. Asked to (`FieldChoice`), a reader also keeps each record's other fields
(JSON keys, Parquet and CSV columns, WebDataset members), typed: see `FileRecords.fields_table`.

Nothing is read unbounded: a line or member longer than `record_byte_cap(max_chars)` is
rejected `too_long` before it is copied or decoded, and a reject keeps the first
`RAW_PREFIX_BYTES` of its record. A file expands in its worker's memory to at most
`expansion_limit` (the registry's decompression, the Parquet reader's pages and dictionaries).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from petatrain.errors import PetatrainError

MAX_EXPANDED_BYTES = 4 << 30  # per file: past it a source is unreadable_file, not a worker OOM
# What a file expands to is held with the records parsed from it: a file may take this share of
# the memory its worker has left.
MEMORY_SHARE = 4
RAW_PREFIX_BYTES = 4096  # of a rejected record's bytes, kept in its reject; the detail gives the full length
_BYTES_PER_CHAR = 12  # the most a char takes in JSON: an astral one as an escaped surrogate pair, \ud83d\ude00
_RECORD_SLACK_BYTES = 1 << 20  # the rest of a record beside its text: keys, quotes, other fields


@dataclass(slots=True)
class Reject:
    index: int  # record number in the file (line number for line formats, 0-based)
    reason: str
    detail: str = ""
    raw: bytes | None = None


@dataclass(frozen=True, slots=True)
class FieldChoice:
    """Which source fields besides the text a dataset keeps: `keep` None is every one."""

    keep: tuple[str, ...] | None = None
    drop: tuple[str, ...] = ()

    @classmethod
    def parse(cls, fields: str, drop_fields: str = "") -> FieldChoice:
        """From `--fields a,b` ("*": every field, "": none) and `--drop-fields c,d`."""
        keep = None if fields.strip() == "*" else tuple(n.strip() for n in fields.split(",") if n.strip())
        return cls(keep=keep, drop=tuple(n.strip() for n in drop_fields.split(",") if n.strip()))

    @property
    def none(self) -> bool:
        return self.keep == ()

    def wanted(self, name: str) -> bool:
        return name not in self.drop and (self.keep is None or name in self.keep)


@dataclass(slots=True)
class FileRecords:
    index: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    # The kept records' other fields, when a FieldChoice asks for them: one dict per kept
    # record (JSON, WebDataset), or row-aligned tables (Parquet, CSV).
    choice: FieldChoice | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    tables: list[pa.Table] = field(default_factory=list)
    columnar: bool = False  # the fields come in `tables`, not `rows`

    def keep(self, index: int, text: str, fields: dict[str, Any] | None = None) -> None:
        self.index.append(index)
        self.text.append(text)
        if self.choice is not None and not self.columnar:
            self.rows.append(fields or {})

    def reject(self, index: int, reason: str, detail: str = "", raw: bytes | memoryview | None = None) -> None:
        if raw is not None:
            if len(raw) > RAW_PREFIX_BYTES:
                kept = f"raw is {len(raw)} bytes, the first {RAW_PREFIX_BYTES} kept"
                detail = f"{detail}; {kept}" if detail else kept
            raw = bytes(raw[:RAW_PREFIX_BYTES])
        self.rejects.append(Reject(index, reason, detail, raw))

    def fields_table(self) -> pa.Table | None:
        """The kept records' fields, one row per kept record, or None when none were asked for.

        Columns from Parquet and CSV keep their Arrow types. JSON values are typed per field:
        booleans, int64, float64 (integers and floats mixed), strings; a field whose values
        are nested (objects, lists) or of mixed kinds holds strings, the others as JSON text.
        """
        if self.choice is None:
            return None
        if self.columnar:
            return pa.concat_tables(self.tables) if self.tables else pa.table({})
        return pa.table({name: typed_array(values) for name, values in self._columns().items()})

    def field_texts(self) -> tuple[pa.Table, dict[str, list[str]]]:
        """A piece of a split file's fields, untyped: each value as its JSON text, and each field's
        kinds (`value_kinds`). A piece cannot type its fields alone: its integers and one float
        would be float64, writing 1 as "1.0" where an object further on makes the whole file's
        field JSON text, "1". So the pieces' kinds are joined per file, and
        `typed_array(values, kinds)` types every piece as the whole file."""
        assert self.choice is not None and not self.columnar  # split formats are line formats
        columns = self._columns()
        texts = {
            name: pa.array([None if v is None else json_text(v) for v in values], pa.large_string())
            for name, values in columns.items()
        }
        return pa.table(texts), {name: sorted(value_kinds(values)) for name, values in columns.items()}

    def _columns(self) -> dict[str, list[Any]]:
        """The kept records' fields by name, in first-seen order, None where a record has none."""
        assert self.choice is not None
        n = len(self.rows)
        columns: dict[str, list[Any]] = {name: [None] * n for name in self.choice.keep or ()}
        for i, row in enumerate(self.rows):  # one pass over the records, in first-seen field order
            for name, value in row.items():
                column = columns.get(name)
                if column is None:
                    column = columns[name] = [None] * n
                column[i] = value
        return columns

    def subset(self, positions: list[int]) -> FileRecords:
        """A copy holding only the kept records at `positions` (their fields too), and every reject."""
        out = FileRecords(rejects=list(self.rejects), choice=self.choice, columnar=self.columnar)
        out.index = [self.index[i] for i in positions]
        out.text = [self.text[i] for i in positions]
        if self.tables:
            out.tables = [pa.concat_tables(self.tables).take(pa.array(positions, pa.int64()))]
        elif self.choice is not None:
            out.rows = [self.rows[i] for i in positions]
        return out


def value_kinds(values: list[Any]) -> set[str]:
    """The kinds of one field's values that decide its type: their Python type names, with
    integers beyond int64 as "bigint"."""
    kinds = {type(v).__name__ for v in values if v is not None}
    if kinds == {"int"}:
        try:
            pa.array(values, pa.int64())
        except (OverflowError, pa.ArrowException):
            return {"bigint"}
    return kinds


def typed_array(values: list[Any], kinds: set[str] | None = None) -> pa.Array:
    """One JSON field's values as a typed Arrow array (see `FileRecords.fields_table`), typed by
    `kinds`: the values' own (`value_kinds`), or a whole file's for one piece of it."""
    if kinds is None:  # as `value_kinds`, converting an int64 column once
        kinds = {type(v).__name__ for v in values if v is not None}
        if kinds == {"int"}:
            try:
                return pa.array(values, pa.int64())
            except (OverflowError, pa.ArrowException):
                kinds = {"bigint"}  # beyond int64: kept exactly, as JSON text
    if not kinds:
        return pa.nulls(len(values))
    if kinds == {"bool"}:
        return pa.array(values, pa.bool_())
    if kinds == {"int"}:
        return pa.array(values, pa.int64())
    if "float" in kinds and kinds <= {"int", "bigint", "float"}:
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    if kinds == {"str"}:
        return pa.array(values, pa.large_string())
    if "bytes" in kinds and kinds <= {"bytes", "str"}:  # WebDataset members: text where it decodes, else bytes
        return pa.array([v.encode() if isinstance(v, str) else v for v in values], pa.large_binary())
    texts = [v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str) for v in values]
    try:
        return pa.array(texts, pa.large_string())
    except (UnicodeEncodeError, pa.ArrowException):  # a lone surrogate in a nested value: that value escaped
        return pa.array([v if v is None or isinstance(v, str) else json_text(v) for v in values], pa.large_string())


def json_text(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON \\ud800 escape: kept as its escape
        text = json.dumps(value, default=str)
    return text


def record_byte_cap(max_chars: int) -> int:
    """The most bytes a raw record holding a text of `max_chars` can take; longer ones are
    rejected `too_long` unread."""
    return _BYTES_PER_CHAR * max_chars + _RECORD_SLACK_BYTES


def capped_lines(data: bytes, max_bytes: int, out: FileRecords) -> Iterator[tuple[int, bytes]]:
    """Numbered lines without their line ending. A line over `max_bytes` is rejected
    `too_long` here, never copied or decoded: one giant line costs nothing beyond the file."""
    view = memoryview(data)
    start = 0
    for number in itertools.count():
        end = data.find(b"\n", start)
        stop = len(data) if end < 0 else end
        if data.endswith(b"\r", start, stop):
            stop -= 1
        if stop - start > max_bytes:
            out.reject(number, "too_long", f"over the {max_bytes}-byte cap that max_chars sets", view[start:stop])
        else:
            yield number, data[start:stop]
        if end < 0:
            return
        start = end + 1


def decode_utf8(number: int, raw: bytes, out: FileRecords) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        out.reject(number, "invalid_utf8", str(exc)[:200], raw)
        return None


def parse_json(number: int, raw: bytes, out: FileRecords) -> tuple[bool, object]:
    """(True, value), or (False, None) with the record rejected: whatever the parser raises
    on one record (RecursionError, ValueError, MemoryError, ...) is that record's fault."""
    try:
        return True, json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        out.reject(number, "invalid_utf8", str(exc)[:200], raw)
    except RecursionError:
        out.reject(number, "malformed_json", "nested too deeply", raw)
    except json.JSONDecodeError as exc:
        out.reject(number, "malformed_json", str(exc)[:200], raw)
    except Exception as exc:
        out.reject(number, "malformed_json", f"{type(exc).__name__}: {exc}"[:200], raw)
    return False, None


def take_field(
    number: int, value: object, text_field: str, raw: bytes, out: FileRecords, extra: dict[str, Any] | None = None
) -> None:
    if not isinstance(value, dict):
        out.reject(number, "malformed_record", f"expected an object, got {type(value).__name__}", raw)
    elif text_field not in value or value[text_field] is None:
        out.reject(number, "missing_field", f"no field {text_field!r}", raw)
    elif not isinstance(value[text_field], str):
        out.reject(number, "field_not_string", f"{text_field!r} is {type(value[text_field]).__name__}", raw)
    elif out.choice is None:
        out.keep(number, value[text_field])
    else:
        choice = out.choice
        if choice.keep is None and not choice.drop:  # every field: the common case, without a call per key
            fields = dict(value)
            del fields[text_field]
        else:
            fields = {k: v for k, v in value.items() if k != text_field and choice.wanted(k)}
        fields.update(extra or {})
        # A string field can hold a lone surrogate only if the JSON spelled one as an escape (\ud800).
        bad = None
        if _SURROGATE_ESCAPE.search(raw):
            bad = next((k for k, v in fields.items() if isinstance(v, str) and not _encodable(v)), None)
        if bad is not None:
            out.reject(number, "invalid_utf8", f"field {bad!r} holds a lone surrogate", raw)
        else:
            out.keep(number, value[text_field], fields)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def column_records(
    table: pa.Table, text_field: str, out: FileRecords, first: int, numbers: list[int] | None = None
) -> None:
    """Rows as records, numbered `first + i`, or `numbers[i]` where given."""
    number = (lambda i: numbers[i]) if numbers is not None else (lambda i: first + i)
    if text_field not in table.column_names:
        for i in range(table.num_rows):
            out.reject(number(i), "missing_field", f"no column {text_field!r} in {table.column_names}")
        return
    column = table.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        for i in range(table.num_rows):
            out.reject(number(i), "field_not_string", f"column {text_field!r} is {column.type}")
        return
    out.columnar = True
    kept = []
    for i, value in enumerate(column.to_pylist()):
        if value is None:
            out.reject(number(i), "missing_field", f"{text_field!r} is null")
        else:
            out.keep(number(i), value)
            kept.append(i)
    if out.choice is not None:
        others = [n for n in table.column_names if n != text_field and out.choice.wanted(n)]
        out.tables.append(table.select(others).take(pa.array(kept, pa.int64())))


def expansion_limit(cap: int, left: int | None) -> int:
    """The bytes one file may expand to in memory: `cap`, or a `MEMORY_SHARE`th of the `left`
    bytes its worker has (`host.memory_left`), whichever is less."""
    return min(cap, left // MEMORY_SHARE) if left is not None else cap


def too_large(cap: int, left: int | None, how: str, advice: str) -> PetatrainError:
    """The error for a file that expands past `expansion_limit(cap, left)` `how` ("when
    decompressed"); when the worker's memory, not the cap, set the limit, it says so and `advice`."""
    limit = expansion_limit(cap, left)
    if limit < cap:
        return PetatrainError(
            f"expands past {limit} bytes {how}, 1/{MEMORY_SHARE} of the {left} bytes of memory this ingest "
            f"worker has left; give the workers more memory, or {advice}"
        )
    return PetatrainError(f"expands past {limit} bytes {how}")
