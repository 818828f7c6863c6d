"""Readers for raw input files: JSONL, Parquet, CSV, plain text, WebDataset tars and TFRecord.

Each reader turns one file's bytes into records `(index, text)` and rejects
`(index, reason, detail, raw)`; a malformed record becomes a reject and the file goes
on. A file that cannot be parsed at all becomes one `unreadable_file` reject. Asked to
(`fields`), a reader also keeps each record's other fields (JSON keys, Parquet and CSV
columns, WebDataset members), typed: see `FileRecords.fields_table`.

Nothing is read unbounded: a compressed file is decompressed in chunks up to
`MAX_DECOMPRESSED_BYTES`, a line or member longer than `record_byte_cap(max_chars)` is
rejected `too_long` before it is copied or decoded, and a reject keeps the first
`RAW_PREFIX_BYTES` of its record.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from fsspec.compression import compr
from fsspec.utils import infer_compression

from petatrain.data.buffers import arrow_reader
from petatrain.errors import PetatrainError

FORMATS = ("jsonl", "parquet", "csv", "text", "webdataset", "tfrecord")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".tar": "webdataset",
    ".tfrecord": "tfrecord",
    ".tfrecords": "tfrecord",
}

MAX_DECOMPRESSED_BYTES = 4 << 30  # per file: past it a compressed source is unreadable_file, not a worker OOM
RAW_PREFIX_BYTES = 4096  # of a rejected record's bytes, kept in its reject; the detail gives the full length
_BYTES_PER_CHAR = 12  # the most a char takes in JSON: an astral one as an escaped surrogate pair, \ud83d\ude00
_RECORD_SLACK_BYTES = 1 << 20  # the rest of a record beside its text: keys, quotes, other fields
_DECOMPRESS_CHUNK = 1 << 20


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
    limit = MAX_DECOMPRESSED_BYTES
    out = io.BytesIO()
    with compr[compression](io.BytesIO(data), mode="rb") as handle:
        while chunk := handle.read(min(_DECOMPRESS_CHUNK, limit + 1 - out.tell())):
            out.write(chunk)
            if out.tell() > limit:
                raise PetatrainError(f"expands past {limit} bytes when decompressed")
    return out.getvalue()


def read_file(
    url: str, data: bytes, fmt: str, text_field: str, *, max_chars: int, fields: FieldChoice | None = None
) -> FileRecords:
    """Parse one file's (decompressed) bytes into records and rejects; with `fields`, the
    records' other fields too (`FileRecords.fields_table`)."""
    out = FileRecords(choice=None if fields is None or fields.none else fields)
    reader = _READERS[fmt]
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


def csv_rows_are_lines(data: bytes | memoryview) -> bool:
    """Whether every non-empty line of a CSV is one row: no quote (a quoted field may hold a line
    break) and no bare carriage return (Arrow ends a row there too)."""
    raw = bytes(data) if isinstance(data, memoryview) else data
    return b'"' not in raw and raw.count(b"\r") == raw.count(b"\r\n")


def _lines(data: bytes, max_bytes: int, out: FileRecords) -> Iterator[tuple[int, bytes]]:
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


def _decode(number: int, raw: bytes, out: FileRecords) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        out.reject(number, "invalid_utf8", str(exc)[:200], raw)
        return None


def _parse_json(number: int, raw: bytes, out: FileRecords) -> tuple[bool, object]:
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


def _take_field(
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


def _read_jsonl(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    for number, raw in _lines(data, max_bytes, out):
        if not raw.strip():
            continue  # blank lines separate records; they are not records
        parsed, value = _parse_json(number, raw, out)
        if parsed:
            _take_field(number, value, text_field, raw, out)


def _read_text(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    for number, raw in _lines(data, max_bytes, out):
        if not raw:
            continue
        line = _decode(number, raw, out)
        if line is not None:
            out.keep(number, line)


def _column_records(
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


def _read_parquet(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    handle = pq.ParquetFile(arrow_reader(data))
    names = handle.schema_arrow.names
    columns = [text_field] if text_field in names else names[:1]
    if out.choice is not None:  # only the fields asked for are read
        columns += [n for n in names if n not in columns and out.choice.wanted(n)]
    first = 0
    for batch in handle.iter_batches(columns=columns):
        _column_records(pa.Table.from_batches([batch]), text_field, out, first)
        first += batch.num_rows


def _read_csv(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
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
    _column_records(table, text_field, out, 0, good)
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


# A CSV file as Arrow reads it (its default delimiter and quote, which _read_csv uses),
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


def _read_webdataset(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    """Samples are runs of adjacent members sharing a key (the path up to the name's first
    dot), as in WebDataset: a key that comes back after another one, or an extension that
    repeats within a run, starts a new sample, so no member is ever overwritten. Each
    sample is taken when its run ends, so a tar cut short keeps the samples before the cut."""
    number, key = -1, ""
    members: dict[str, tarfile.TarInfo] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar:
            base = os.path.basename(member.name)
            if not member.isfile() or "." not in base:
                continue
            stem, ext = base.split(".", 1)
            ext = ext.lower()
            member_key = os.path.join(os.path.dirname(member.name), stem)
            if member_key != key or ext in members:
                if members:
                    _take_sample(number, key, members, tar, text_field, max_bytes, out)
                number, key, members = number + 1, member_key, {}
            members[ext] = member
        if members:
            _take_sample(number, key, members, tar, text_field, max_bytes, out)


def _take_sample(
    number: int,
    key: str,
    members: dict[str, tarfile.TarInfo],
    tar: tarfile.TarFile,
    text_field: str,
    max_bytes: int,
    out: FileRecords,
) -> None:
    """The sample's text: member `.text_field`, else `.txt`, else the field of `.json`.
    Only that member is read, and only if it is within `max_bytes`; with fields asked for,
    the other members too (each a field named by its extension: text where it decodes as
    UTF-8, else bytes) and the sample's `__key__`."""
    ext = next((e for e in (text_field, "txt", "json") if e in members), None)
    if ext is None:
        out.reject(number, "missing_field", f"sample {key} has no .{text_field}, .txt or .json member")
        return
    extra: dict[str, Any] = {}
    wanted = [e for e in members if e != ext and out.choice is not None and out.choice.wanted(e)]
    for name in [ext, *wanted]:
        member = members[name]
        handle = tar.extractfile(member)
        assert handle is not None  # members are regular files (`member.isfile()`)
        if member.size > max_bytes:
            detail = f"{member.name} is {member.size} bytes, over the {max_bytes}-byte cap that max_chars sets"
            out.reject(number, "too_long", detail, handle.read(RAW_PREFIX_BYTES))
            return
        if name != ext:
            data = handle.read()
            try:
                extra[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                extra[name] = data
    if out.choice is not None and out.choice.wanted("__key__"):
        extra["__key__"] = key
    handle = tar.extractfile(members[ext])
    assert handle is not None
    raw = handle.read()
    if ext == "json" and text_field != "json":
        parsed, value = _parse_json(number, raw, out)
        if parsed:
            _take_field(number, value, text_field, raw, out, extra)
    else:
        text = _decode(number, raw, out)
        if text is not None:
            out.keep(number, text, extra)


# TFRecord framing: uint64 length, masked CRC32C of those 8 bytes, the data, masked CRC32C of the data.
_TFRECORD_HEADER = 12
_CRC_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's checksum: CRC32C rotated right by 15 bits plus a constant (so a CRC over
    data that holds CRCs is not degenerate)."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def _header_at(data: bytes, pos: int) -> int | None:
    """The record length framed at `pos`, or None where its header's checksum fails."""
    if len(data) - pos < _TFRECORD_HEADER:
        return None
    length = int.from_bytes(data[pos : pos + 8], "little")
    return length if masked_crc32c(data[pos : pos + 8]) == int.from_bytes(data[pos + 8 : pos + 12], "little") else None


def _read_tfrecord(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    """Records are `tf.train.Example`s; the text is the single bytes value of feature `text_field`.

    Both checksums are checked. A record whose data fails its checksum is rejected and the next
    one read (its length was checked). A header that fails its checksum leaves no trusted
    length: the record is rejected and reading resumes at the next offset that frames a valid
    header, so one flipped byte costs one record, never the rest of the file."""
    view = memoryview(data)
    pos, number = 0, 0
    while pos < len(data):
        length = _header_at(data, pos)
        if length is None:
            if len(data) - pos < _TFRECORD_HEADER:
                out.reject(number, "corrupt_record", f"the file ends inside a record header at byte {pos}", view[pos:])
                return
            resume = _next_header(data, pos + 1)
            detail = f"the record header at byte {pos} fails its CRC32C; resumed at byte {resume}"
            out.reject(number, "corrupt_record", detail, view[pos:resume])
            pos, number = resume, number + 1
            continue
        start, end = pos + _TFRECORD_HEADER, pos + _TFRECORD_HEADER + length
        if end + 4 > len(data):
            out.reject(number, "corrupt_record", f"the file ends inside the record at byte {pos}", view[start:])
            return
        payload = view[start:end]
        if length > max_bytes:
            out.reject(number, "too_long", f"over the {max_bytes}-byte cap that max_chars sets", payload)
        elif masked_crc32c(payload) != int.from_bytes(data[end : end + 4], "little"):
            out.reject(number, "corrupt_record", f"the record at byte {pos} fails its CRC32C", payload)
        else:
            _take_example(number, payload, text_field, out)
        pos, number = end + 4, number + 1


def _next_header(data: bytes, pos: int) -> int:
    """The first offset from `pos` that frames a header with a valid checksum, or the end.

    Only offsets whose length has its top three bytes zero (a record under 1 TiB) are tried,
    found by `bytes.find` at C speed: garbage is skipped without a checksum per byte."""
    while True:
        zeros = data.find(b"\0\0\0", pos + 5)
        if zeros < 0 or zeros - 5 > len(data) - _TFRECORD_HEADER:
            return len(data)
        if _header_at(data, zeros - 5) is not None:
            return zeros - 5
        pos = zeros - 4


def _take_example(number: int, payload: memoryview, text_field: str, out: FileRecords) -> None:
    example = _example_class()()
    try:
        example.ParseFromString(payload)
    except Exception as exc:  # DecodeError, or anything the parser raises on hostile bytes
        out.reject(number, "malformed_record", f"not a tf.train.Example: {exc}"[:200], payload)
        return
    features = example.features.feature
    if text_field not in features:
        out.reject(number, "missing_field", f"no feature {text_field!r}", payload)
        return
    feature = features[text_field]
    kind = feature.WhichOneof("kind")
    if kind != "bytes_list" or len(feature.bytes_list.value) != 1:
        held = f"{len(feature.bytes_list.value)} bytes values" if kind == "bytes_list" else kind or "nothing"
        out.reject(number, "field_not_string", f"feature {text_field!r} holds {held}, not one bytes value", payload)
        return
    text = _decode(number, feature.bytes_list.value[0], out)
    if text is not None:
        out.keep(number, text)


@functools.cache
def _example_class() -> type:
    """`tf.train.Example` (tensorflow/core/example/{example,feature}.proto), built from its
    descriptor in a private pool: no TensorFlow, no generated code, and no clash with a
    TensorFlow that registers the same names in the default pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fd = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="petatrain/tf_example.proto", package="tensorflow", syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        msg = proto.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            added = msg.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                added.type_name = type_name
        return msg

    repeated, optional = fd.LABEL_REPEATED, fd.LABEL_OPTIONAL
    message("BytesList", ("value", 1, repeated, fd.TYPE_BYTES, ""))
    message("FloatList", ("value", 1, repeated, fd.TYPE_FLOAT, ""))
    message("Int64List", ("value", 1, repeated, fd.TYPE_INT64, ""))
    feature = message(
        "Feature",
        ("bytes_list", 1, optional, fd.TYPE_MESSAGE, ".tensorflow.BytesList"),
        ("float_list", 2, optional, fd.TYPE_MESSAGE, ".tensorflow.FloatList"),
        ("int64_list", 3, optional, fd.TYPE_MESSAGE, ".tensorflow.Int64List"),
    )
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message("Features", ("feature", 1, repeated, fd.TYPE_MESSAGE, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, label=optional, type=fd.TYPE_STRING)
    entry.field.add(name="value", number=2, label=optional, type=fd.TYPE_MESSAGE, type_name=".tensorflow.Feature")
    message("Example", ("features", 1, optional, fd.TYPE_MESSAGE, ".tensorflow.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


_READERS: dict[str, Callable[[bytes, str, int, FileRecords], None]] = {
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "csv": _read_csv,
    "text": _read_text,
    "webdataset": _read_webdataset,
    "tfrecord": _read_tfrecord,
}
