"""The ingest stages that run as Ray tasks, and the shard plan between them.

`ReadCleanSign` turns one source file into staged documents, dedup signatures and rejects;
`plan_shards` cuts the kept documents, in input order, into shards; `ShardWriter` writes
one shard (tokenised and packed if asked) and the dedup state an `--append` compares
against. `pipeline.py` runs them in order and commits.

A document's id (`ord`, the shards' `doc_id`) is `file_ord << FILE_BITS | record number`:
input order, which makes every decision independent of how many workers ran.

The source fields kept beside the text are staged per file (`fields/`, row-aligned with
`docs/`) with the types that file gave them; `unify_fields` picks one type per field for
the whole batch, and `ShardWriter` converts each file's columns to it, so every shard of
a dataset has the same schema. A piece of a split file stages its fields untyped, with
their kinds: the driver joins its pieces' kinds, so a split file's fields are typed as
the file read whole types them (`split_field_types`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from petatrain.config import IngestConfig
from petatrain.data import readers as src
from petatrain.data.buffers import arrow_reader
from petatrain.data.ingest import clean as cleaning
from petatrain.data.ingest import split
from petatrain.data.ingest import tokenize as tk
from petatrain.data.ingest.minhash import LSHParams, signatures
from petatrain.data.partitions import partition_array
from petatrain.errors import PetatrainError
from petatrain.security import signing
from petatrain.security.parquet_crypt import DatasetKeys, open_parquet
from petatrain.storage import StorageOptions, atomic_write, join, read_bytes
from petatrain.storage.fs import RangeReader, read_range, resolve
from petatrain.storage.retry import retrying

FILE_BITS = 36  # records per file < 2^36; files per dataset < 2^27
STREAM_PIECE_BYTES = 64 << 20  # a streamed file's piece where ingest.split_size is 0
_STAGED_ROW_GROUP = 4096
_SHARD_ROW_GROUP = 4096
_SIGN_CHUNK = 2048  # documents per MinHash batch (bounds the (perms, shingles) block)
# Columns petatrain writes itself; a source field may not take one of these names.
RESERVED_COLUMNS = ("doc_id", "text", "tokens", "num_tokens")
# Records whose keys are data (an id per key) would make a column per record: past this, name the fields.
MAX_FIELDS = 1000


def staged_name(file_ord: int, piece: int) -> str:
    """The staged docs/sigs/rejects file of one piece of a source file (a file read whole is piece 0)."""
    return f"f-{file_ord:08d}-p{piece:05d}.parquet"


def whole_file(file_ord: int, url: str, size: int) -> dict[str, Any]:
    """The first stage's item for a file read whole; a piece sets start, end, first_record, header_end."""
    return {
        "file_ord": file_ord,
        "url": url,
        "size": size,
        "piece": 0,
        "start": 0,
        "end": -1,
        "first_record": 0,
        "header_end": 0,
    }


class ReadCleanSign:
    """A Ray task's body: one source file, or one piece of a split one -> staged docs, signatures
    and rejects."""

    def __init__(
        self,
        *,
        staging: str,
        cfg: IngestConfig,
        options: StorageOptions | None,
        lsh: LSHParams | None,
        crypt: DatasetKeys | None = None,
        fields: src.FieldChoice | None = None,
    ):
        self.staging, self.cfg, self.options, self.lsh, self.crypt = staging, cfg, options, lsh, crypt
        self.fields = fields  # None: keep no source fields

    def __call__(self, item: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        if int(item["end"]) < 0 and src.streamed(item["url"], self.cfg.format):
            return self._stream(item)
        return self._stage(item, *self._read(item))

    def _stream(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A compressed file of line records, decompressed as it is read (`readers.read_stream`): each
        piece staged as it comes, as a split file's pieces are (piece 0, 1, ...), so the worker holds
        one piece, not the file. The file's checksum and size go with every piece (the lineage's);
        one that does not decompress is one unreadable_file record, its pieces staged so far unused."""
        url, size = item["url"], int(item["size"])
        fmt = self.cfg.format if self.cfg.format != "auto" else src.detect_format(url)
        digest = split.StreamChecksum()
        raw = RangeReader(url, size, self.options, changed=lambda how: split.changed(url, how), seen=digest.update)
        stats: list[dict[str, Any]] = []
        pieces = src.read_stream(
            url, io.BufferedReader(raw, raw.block), fmt, self.cfg.text_field, max_chars=self.cfg.max_chars,
            piece_bytes=self.cfg.split_bytes() or STREAM_PIECE_BYTES, fields=self.fields,
        )  # fmt: skip
        with _source_errors(url):
            while True:
                try:
                    records = next(pieces, None)
                except Exception as exc:  # the stream does not decompress (torn, corrupt, a bomb past the cap)
                    if raw.failed:  # the source itself (gone, changed, unreachable): not a fault of its bytes
                        raise
                    stats = [self.crashed({**item, "piece": 0}, f"{type(exc).__name__}: {exc}")]
                    break
                if records is None:
                    break
                stats.append(self._stage({**item, "piece": len(stats)}, records, "", 0, piece=True))
            rest = bytearray(raw.block)
            while raw.readinto(rest):  # what the decompressor did not need: in the checksum too
                pass
        checksum = digest.result()
        for stat in stats:
            stat["checksum"] = checksum
        stats[0]["size"] = digest.size
        return stats

    def crashed(self, item: dict[str, Any], why: str) -> dict[str, Any]:
        """What stands for an item whose every reading process died (killed for memory, crashed), or
        a stream that does not decompress: the file (or piece) quarantined as unreadable_file with
        `why`, nothing of it kept. Its checksum is unknown here ("")."""
        records = src.FileRecords()
        records.reject(0, "unreadable_file", why[:500])
        return self._stage(item, records, "", 0)

    def _stage(
        self, item: dict[str, Any], records: src.FileRecords, checksum: str, size: int, *, piece: bool | None = None
    ) -> dict[str, Any]:
        """Stage one file's or piece's records (`piece`: whether they are a piece of a file, whose
        fields the file's pieces type together; by default, whether `item` is a split file's piece)."""
        in_piece = int(item["end"]) >= 0 if piece is None else piece
        url, file_ord, piece_no = item["url"], int(item["file_ord"]), int(item["piece"])
        records = cleaning.clean(records, min_chars=self.cfg.min_chars, max_chars=self.cfg.max_chars)
        name = staged_name(file_ord, piece_no)
        fields_schema = b""
        partitions = json.loads(item.get("partitions") or "{}")
        fields, field_kinds = self._fields(records, partitions, piece=in_piece)
        if fields is not None:
            fields_schema = fields.schema.serialize().to_pybytes()
            write_parquet(
                join(self.staging, "fields", name),
                fields,
                self.options,
                crypt=self.crypt,
                row_group_size=_STAGED_ROW_GROUP,
            )
        ords = (np.int64(file_ord) << np.int64(FILE_BITS)) | np.asarray(records.index, dtype=np.int64)
        encoded = [t.encode("utf-8") for t in records.text]
        nbytes = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        docs = pa.table({"ord": ords, "text": pa.array(records.text, pa.large_string())})
        # Documents and rejects hold the sources' text: encrypted like the shards. Signatures are hashes.
        write_parquet(
            join(self.staging, "docs", name), docs, self.options, crypt=self.crypt, row_group_size=_STAGED_ROW_GROUP
        )
        if self.cfg.dedup != "none":
            digests = [xxhash.xxh3_128_intdigest(b) for b in encoded]
            columns = {
                "ord": ords,
                "nbytes": nbytes,
                "h_hi": np.fromiter((d >> 64 for d in digests), dtype=np.uint64, count=len(digests)),
                "h_lo": np.fromiter((d & 0xFFFFFFFFFFFFFFFF for d in digests), dtype=np.uint64, count=len(digests)),
            }
            if self.lsh is not None:
                columns["sig"] = sign(docs.column("text"), self.lsh)
            write_parquet(
                join(self.staging, "sigs", name), pa.table(columns), self.options, row_group_size=_STAGED_ROW_GROUP
            )
        reasons = Counter(r.reason for r in records.rejects)
        if records.rejects:
            rejects = pa.table(
                {
                    "source": [url] * len(records.rejects),
                    "record": [r.index for r in records.rejects],
                    "reason": [r.reason for r in records.rejects],
                    "detail": [r.detail for r in records.rejects],
                    "raw": pa.array([r.raw for r in records.rejects], pa.large_binary()),
                }
            )
            write_parquet(join(self.staging, "rejects", name), rejects, self.options, crypt=self.crypt)
        return {
            "file_ord": file_ord,
            "piece": piece_no,
            "url": url,
            "checksum": checksum,
            "size": size,
            "rows_in": len(records.index) + len(records.rejects),
            "kept": len(records.index),
            "kept_bytes": int(nbytes.sum()),
            "rejects": json.dumps(dict(reasons)),
            "fields": fields_schema,
            "field_kinds": json.dumps(field_kinds),  # a piece's untyped fields (see `_fields`)
        }

    def _fields(
        self, records: src.FileRecords, partitions: dict[str, str], *, piece: bool
    ) -> tuple[pa.Table | None, dict[str, list[str]]]:
        """The kept records' fields, with the file's Hive partition values (`key=value` folders) as
        constant columns; None when there are none to keep. A piece of a split file stages its
        record fields as JSON text, with their kinds, for the file's type (`FileRecords.field_texts`)."""
        if self.fields is None:
            return None, {}
        kinds: dict[str, list[str]] = {}
        if piece and not records.columnar:
            table, kinds = records.field_texts()
        else:
            table = records.fields_table()
        columns = {name: table.column(name) for name in table.column_names} if table is not None else {}
        for key, value in partitions.items():
            if self.fields.wanted(key) and key not in columns:
                columns[key] = partition_array(value, len(records.index))
        return (pa.table(columns) if columns else None), kinds

    def _read(self, item: dict[str, Any]) -> tuple[src.FileRecords, str, int]:
        """(records, checksum, bytes read): a piece's checksum is "" (the split scan has the file's)."""
        url, start, end = item["url"], int(item["start"]), int(item["end"])
        with _source_errors(url):
            if end >= 0:
                data = read_range(url, start, end, self.options)
                header_end = int(item["header_end"])
                header = read_range(url, 0, header_end, self.options) if header_end else b""
            else:
                data = read_bytes(url, self.options)
        if end >= 0:
            split.check_piece(url, item, data, header)
            fmt = self.cfg.format if self.cfg.format != "auto" else src.detect_format(url)
            records = src.read_piece(
                url,
                data,
                fmt,
                self.cfg.text_field,
                max_chars=self.cfg.max_chars,
                first_record=int(item["first_record"]),
                header=header,
                fields=self.fields,
            )
            return records, "", len(data)
        if int(item["size"]) and len(data) != int(item["size"]):  # the lineage records the listed size
            raise PetatrainError(split.changed(url, f"{len(data)} bytes read, {item['size']} when it was listed"))
        checksum, size = split.whole_file_checksum(data), len(data)
        try:
            fmt = self.cfg.format if self.cfg.format != "auto" else src.detect_format(url)
            data = src.decompress(url, data)
        except Exception as exc:
            records = src.FileRecords()
            records.reject(0, "unreadable_file", f"{type(exc).__name__}: {exc}"[:500])
            return records, checksum, size
        records = src.read_file(url, data, fmt, self.cfg.text_field, max_chars=self.cfg.max_chars, fields=self.fields)
        return records, checksum, size


@contextlib.contextmanager
def _source_errors(url: str) -> Iterator[None]:
    """A source file gone or unreadable while it is read: one line naming it."""
    try:
        yield
    except FileNotFoundError:
        raise PetatrainError(f"source disappeared during the ingest: {url}") from None
    except PermissionError as exc:
        raise PetatrainError(f"source not readable: {url} ({exc})") from None


def split_field_types(file_stats: list[dict]) -> dict[int, dict[str, list[str]]]:
    """A split file's field kinds, joined over its pieces (by file_ord, then field), and each of
    its pieces' staged schema (`fields` in `file_stats`) replaced by the file's: the types a
    whole read gives, in its order (record fields as first seen, then Hive partitions)."""
    kinds: dict[int, dict[str, set[str]]] = {}
    partitions: dict[int, dict[str, pa.DataType]] = {}
    for stat in file_stats:  # in (file_ord, piece) order
        piece_kinds = json.loads(stat.get("field_kinds") or "{}")
        if not piece_kinds or not stat["fields"]:
            continue
        file_ord = stat["file_ord"]
        for name, found in piece_kinds.items():
            kinds.setdefault(file_ord, {}).setdefault(name, set()).update(found)
        for f in pa.ipc.read_schema(pa.py_buffer(stat["fields"])):  # partition columns: typed by the piece
            if f.name not in piece_kinds:
                partitions.setdefault(file_ord, {}).setdefault(f.name, f.type)
    serialized = {}
    for file_ord, found in kinds.items():
        types = {name: src.typed_array([], k).type for name, k in found.items()}
        types |= {n: t for n, t in partitions.get(file_ord, {}).items() if n not in types}
        serialized[file_ord] = pa.schema(list(types.items())).serialize().to_pybytes()
    for stat in file_stats:
        if stat["file_ord"] in serialized and stat["fields"]:
            stat["fields"] = serialized[stat["file_ord"]]
    return {o: {name: sorted(k) for name, k in found.items()} for o, found in kinds.items()}


def unify_fields(schemas: list[pa.Schema], existing: pa.Schema | None = None) -> pa.Schema:
    """One type per source field across files: each file's own where they agree, a null column
    takes the other's, integers with floats are float64, Arrow's permissive promotion where it
    has one, and otherwise strings (values that are not strings become their JSON text).
    `existing`: an append's dataset fields, which keep their types (an error names a field
    whose new values do not fit, or a field the dataset does not have)."""
    order: dict[str, list[pa.DataType]] = {}
    for schema in ([existing] if existing is not None else []) + schemas:
        for f in schema:
            order.setdefault(f.name, []).append(f.type)
    if len(order) > MAX_FIELDS:
        raise PetatrainError(
            f"the sources have {len(order)} distinct fields (first: {', '.join(list(order)[:5])}, ...), over the "
            f"{MAX_FIELDS} columns a dataset keeps; name the ones to keep with --fields a,b"
        )
    for name in order:
        if name in RESERVED_COLUMNS:
            raise PetatrainError(
                f"source field {name!r} has the name of a column petatrain writes; leave it out with "
                f"--drop-fields {name} (or rename it in the source)"
            )
    unified = pa.schema([pa.field(name, _unify(types)) for name, types in order.items()])
    if existing is not None:
        for f in unified:
            if f.name not in existing.names:
                raise PetatrainError(
                    f"source field {f.name!r} is not in the dataset "
                    f"(its fields: {', '.join(existing.names) or 'none'}); "
                    f"an append keeps the dataset's columns: pass --drop-fields {f.name}, or ingest into a new --out"
                )
            if not f.type.equals(existing.field(f.name).type):
                raise PetatrainError(
                    f"source field {f.name!r} is {f.type} in the new files; the dataset has it as "
                    f"{existing.field(f.name).type}. Pass --drop-fields {f.name}, or ingest into a new --out"
                )
    return unified


def _unify(types: list[pa.DataType]) -> pa.DataType:
    known = [t for t in types if not pa.types.is_null(t)]
    if not known:
        return pa.large_string()  # never seen with a value: a string column of nulls, which every reader takes
    if all(t.equals(known[0]) for t in known):
        return known[0]
    if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in known):
        return pa.int64() if all(pa.types.is_integer(t) for t in known) else pa.float64()
    if all(pa.types.is_string(t) or pa.types.is_large_string(t) for t in known):
        return pa.large_string()
    try:
        merged = pa.unify_schemas([pa.schema([("f", t)]) for t in known], promote_options="permissive")
        return merged.field("f").type
    except (pa.ArrowException, TypeError):
        return pa.large_string()


def conform(column: pa.ChunkedArray | pa.Array, target: pa.DataType, name: str) -> pa.ChunkedArray | pa.Array:
    """`column` as the unified type `target`: cast, or its JSON text when the target is a string
    its type does not cast to."""
    if column.type.equals(target):
        return column
    string_target = pa.types.is_large_string(target) or pa.types.is_string(target)
    if string_target and not (
        pa.types.is_null(column.type) or pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    ):
        return pa.array([None if v is None else src.json_text(v) for v in column.to_pylist()], target)
    try:
        return column.cast(target)
    except (pa.ArrowException, TypeError) as exc:
        raise PetatrainError(
            f"source field {name!r}: {column.type} values do not convert to {target} ({exc})"
        ) from None


def sign(texts: pa.ChunkedArray, lsh: LSHParams) -> pa.Array:
    """MinHash signatures as fixed_size_binary(2 * num_perm), computed in chunks."""
    flat = texts.combine_chunks()
    parts = [signatures(flat.slice(i, _SIGN_CHUNK), lsh) for i in range(0, len(flat), _SIGN_CHUNK)]
    sig = np.concatenate(parts) if parts else np.empty((0, lsh.num_perm), np.uint16)
    width = sig.itemsize * lsh.num_perm
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), len(sig), [None, pa.py_buffer(np.ascontiguousarray(sig).tobytes())]
    )


def write_parquet(
    url: str, table: pa.Table, options: StorageOptions | None, *, crypt: DatasetKeys | None = None, **kwargs
) -> tuple[str, int]:
    """Write `table` as Parquet at `url`, all or nothing; encrypted under `crypt`'s write key if given."""
    return atomic_write(url, encode_parquet(table, crypt, **kwargs), options)


def encode_parquet(table: pa.Table, crypt: DatasetKeys | None = None, **kwargs) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, encryption_properties=crypt.encryption_properties() if crypt else None, **kwargs)
    return sink.getvalue().to_pybytes()


def read_parquet(url: str, options: StorageOptions | None, crypt: DatasetKeys | None = None) -> pq.ParquetFile:
    return open_parquet(arrow_reader(read_bytes(url, options)), crypt)


def plan_shards(file_stats: list[dict], drops: dict[int, dict], shard_bytes: int, *, first_shard: int) -> list[dict]:
    """Cut the documents, in input order, into shards of about `shard_bytes` kept bytes.

    `file_stats` has one entry per piece, in (file_ord, piece) order. Segments are ranges of
    staged rows of one piece, `[file_ord, piece, start, end]`; a file's kept bytes per staged
    row is its average over its pieces, so the plan needs per-file counts only, and a file is
    cut into the same shards however it was split.
    """
    specs: list[dict] = []
    segments: list[list[int]] = []
    budget = float(shard_bytes)
    files: dict[int, list[dict]] = {}
    for stat in file_stats:
        files.setdefault(stat["file_ord"], []).append(stat)
    for file_ord, pieces in files.items():
        staged, kept_bytes = sum(p["kept"] for p in pieces), sum(p["kept_bytes"] for p in pieces)
        if staged == 0:
            continue
        dropped = drops.get(file_ord, {})
        kept_bytes -= dropped.get("dropped_bytes", 0)
        if staged - dropped.get("dropped", 0) == 0:
            continue
        per_row = max(kept_bytes / staged, 1e-9)
        start = 0
        while start < staged:
            take = min(staged - start, max(1, math.ceil(budget / per_row)))
            segments.extend(_piece_ranges(file_ord, pieces, start, start + take))
            budget -= take * per_row
            start += take
            if budget <= 0:
                specs.append({"shard": first_shard + len(specs), "segments": json.dumps(segments)})
                segments, budget = [], float(shard_bytes)
    if segments:
        specs.append({"shard": first_shard + len(specs), "segments": json.dumps(segments)})
    return specs


def _piece_ranges(file_ord: int, pieces: list[dict], start: int, end: int) -> list[list[int]]:
    """Rows [start, end) of a file's staged rows as ranges within its pieces."""
    out, offset = [], 0
    for p in pieces:
        lo, hi = max(start, offset), min(end, offset + p["kept"])
        if lo < hi:
            out.append([file_ord, int(p["piece"]), lo - offset, hi - offset])
        offset += p["kept"]
    return out


class ShardWriter:
    """A Ray task's body: one shard spec -> a Parquet shard (+ its dedup state)."""

    def __init__(
        self,
        *,
        out: str,
        staging: str,
        cfg: IngestConfig,
        options: StorageOptions | None,
        num_groups: int,
        tokenizer_json: str | None,
        batch: int,
        keep_state: bool,
        crypt: DatasetKeys | None = None,
        fields: pa.Schema | None = None,
        staged_fields: frozenset[tuple[int, int]] = frozenset(),
        split_kinds: dict[int, dict[str, list[str]]] | None = None,
        id_column: str = "doc_id",
    ):
        self.out, self.staging, self.cfg, self.options, self.crypt = out, staging, cfg, options, crypt
        # The batch's unified source fields (None: none kept), the (file_ord, piece)s that staged
        # some, and a split file's kinds per field (`FileRecords.field_texts`), by file_ord.
        self.fields, self.staged_fields, self.split_kinds = fields, staged_fields, split_kinds or {}
        self.id_column = id_column  # "id" in datasets written before source fields were kept
        self.num_groups, self.tokenizer_json, self.batch, self.keep_state = (
            num_groups,
            tokenizer_json,
            batch,
            keep_state,
        )
        self._tokenizer: Any = None  # built on first use, in the Ray worker
        self._byte_table: Any = None
        self._groups: dict[int, np.ndarray] = {}

    def __call__(self, spec: dict[str, Any]) -> dict[str, Any]:
        shard = int(spec["shard"])
        ords, texts, state, fields = [], [], [], []
        for file_ord, piece, start, end in json.loads(spec["segments"]):
            docs = self._rows(file_ord, piece, start, end, "docs")
            ords_here = docs.column("ord").to_numpy()
            keep = (
                ~np.isin(ords_here, self._drops(file_ord))
                if self.cfg.dedup != "none"
                else np.ones(len(ords_here), dtype=bool)
            )
            ords.append(ords_here[keep])
            texts.append(docs.column("text").filter(pa.array(keep)))
            if self.keep_state:  # staged signatures are row-aligned with staged docs
                state.append(self._rows(file_ord, piece, start, end, "sigs").filter(pa.array(keep)))
            if self.fields is not None:  # and so are staged fields
                fields.append(self._file_fields(file_ord, piece, start, end).filter(pa.array(keep)))
        ord_arr = np.concatenate(ords)
        text_arr = pa.chunked_array([c for t in texts for c in t.chunks], pa.large_string())
        table, tokens, left_over = self._table(ord_arr, text_arr)
        if fields and self.fields is not None and not self.cfg.pack_length:
            for name, column in zip(self.fields.names, pa.concat_tables(fields).columns, strict=True):
                table = table.append_column(self.fields.field(name), column)
        path = f"data/part-{shard:06d}.parquet"
        data = encode_parquet(table, self.crypt, **shard_layout(table))
        checksum, size = atomic_write(join(self.out, path), data, self.options)
        result = {
            "shard": shard,
            "path": path,
            "rows": table.num_rows,
            "bytes": size,
            "checksum": checksum,
            "key": self.crypt.write_key if self.crypt else "",
            "sha256": signing.sha256_hex(data) if signing.signs(self.options) else "",
            "docs": len(ord_arr),
            "tokens": tokens,
            "left_over": left_over,
            "state": "",
            "state_checksum": "",
        }
        if self.keep_state and state:
            state_path = f"_index/dedup/b{self.batch:06d}-part-{shard:06d}.parquet"
            result["state_checksum"], _ = write_parquet(
                join(self.staging, "state", os.path.basename(state_path)), pa.concat_tables(state), self.options
            )
            result["state"] = state_path
        return result

    def _rows(self, file_ord: int, piece: int, start: int, end: int, kind: str) -> pa.Table:
        """Rows [start, end) of a staged file, reading only the row groups that hold them
        (a large file is split over several shards; no shard reads all of it)."""
        url = join(self.staging, kind, staged_name(file_ord, piece))
        fs, path = resolve(url, self.options)

        def read() -> pa.Table:
            with fs.open(path, "rb") as handle:
                parquet = open_parquet(handle, self.crypt if kind in ("docs", "fields") else None)
                groups: list[int] = []
                first, offset = 0, 0
                found = False
                for g in range(parquet.num_row_groups):
                    n = parquet.metadata.row_group(g).num_rows
                    if offset + n > start and offset < end:
                        groups.append(g)
                        first = first if found else offset
                        found = True
                    offset += n
                return parquet.read_row_groups(groups).slice(start - first, end - start)

        return retrying(f"read {url}", read)

    def _file_fields(self, file_ord: int, piece: int, start: int, end: int) -> pa.Table:
        """Staged rows [start, end) of a piece's fields, as the batch's unified schema."""
        assert self.fields is not None
        if (file_ord, piece) not in self.staged_fields:
            return pa.Table.from_arrays([pa.nulls(end - start, f.type) for f in self.fields], schema=self.fields)
        staged = self._rows(file_ord, piece, start, end, "fields")
        kinds = self.split_kinds.get(file_ord, {})
        columns = [
            conform(self._typed(staged.column(f.name), kinds.get(f.name)), f.type, f.name)
            if f.name in staged.column_names
            else pa.nulls(staged.num_rows, f.type)
            for f in self.fields
        ]
        return pa.Table.from_arrays(columns, schema=self.fields)

    @staticmethod
    def _typed(column: pa.ChunkedArray, kinds: list[str] | None) -> pa.ChunkedArray | pa.Array:
        """A split file's field, staged as JSON text, typed as the whole file types it (`kinds`)."""
        if kinds is None:
            return column
        return src.typed_array([None if t is None else json.loads(t) for t in column.to_pylist()], set(kinds))

    def _drops(self, file_ord: int) -> np.ndarray:
        """Ords of this file's documents that dedup dropped (each group file read once)."""
        group = file_ord % self.num_groups
        if group not in self._groups:
            url = join(self.staging, "dups", f"g-{group:05d}.parquet")
            table = pq.ParquetFile(arrow_reader(read_bytes(url, self.options))).read(columns=["ord"])
            self._groups[group] = table.column("ord").to_numpy()
        ords = self._groups[group]
        return ords[(ords >> FILE_BITS) == file_ord]

    def _table(self, ords: np.ndarray, texts: pa.ChunkedArray) -> tuple[pa.Table, int, int]:
        if not self.tokenizer_json:
            return pa.table({self.id_column: ords, "text": texts}), 0, 0
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
            self._byte_table = tk.byte_table(self._tokenizer)
        tok = self._tokenizer
        dtype = tk.token_dtype(tok)
        encoded = tk.encode(tok, texts.to_pylist(), self._byte_table)
        tokens = int(sum(len(e) for e in encoded))
        if self.cfg.pack_length:
            rows, left = tk.pack(encoded, self.cfg.pack_length, tk.eos_id(tok), dtype)
            width = self.cfg.pack_length * dtype.itemsize
            column = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(width), len(rows), [None, pa.py_buffer(rows.tobytes())]
            )
            schema = pa.schema([pa.field("tokens", column.type, nullable=False)])
            return pa.table([column], schema=schema), tokens, left
        column = pa.array([e.tobytes() for e in encoded], pa.large_binary())
        return (
            pa.table(
                {
                    self.id_column: ords,
                    "text": texts,
                    "tokens": column,
                    "num_tokens": pa.array([len(e) for e in encoded], pa.int32()),
                }
            ),
            tokens,
            0,
        )


def shard_layout(table: pa.Table) -> dict[str, Any]:
    """Parquet settings for a shard.

    Token columns are stored so that reading them costs what the bytes cost: no
    compression, no dictionary, no statistics. A packed shard (one required
    fixed-width `tokens` column) is one row group holding one data page, so its values
    are a single contiguous run of bytes in the file that a loader can map without
    decoding (`stream._zero_copy_view`); any Parquet reader still reads it normally.
    Text is zstd-compressed in row groups of 4096 rows.
    """
    layout: dict[str, Any] = {
        "row_group_size": _SHARD_ROW_GROUP,
        "compression": {name: ("none" if name == "tokens" else "zstd") for name in table.column_names},
        "use_dictionary": [name for name in table.column_names if name != "tokens"],
        "write_statistics": [name for name in table.column_names if name != "tokens"],
    }
    if table.column_names == ["tokens"] and pa.types.is_fixed_size_binary(table.schema.field("tokens").type):
        rows = max(1, table.num_rows)
        layout.update(row_group_size=rows, data_page_size=(1 << 31) - 1, max_rows_per_page=rows)
    return layout
