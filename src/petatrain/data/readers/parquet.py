"""Parquet: a row is a record, the text in column `text_field`; only the columns asked for are read.

A Parquet file is compressed and encoded: a few hundred bytes of dictionary-encoded pages can stand
for gigabytes of strings (one long value, its index repeated). What the columns read expand to is
bounded before it is made (`base.expansion_limit`): the pages by the sizes the footer declares, and
string columns, read as dictionaries, by their values' lengths counted on the dictionary, before
they are decoded. Past the limit the file is unreadable_file, never a worker killed for memory.
(A footer that understates its pages is not caught here; a worker that dies on a file three times
quarantines it: `ingest.pipeline._mapped`.)"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from petatrain.data.buffers import arrow_reader
from petatrain.data.readers.base import MAX_EXPANDED_BYTES, FileRecords, column_records, expansion_limit, too_large
from petatrain.host import memory_left


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    handle = pq.ParquetFile(arrow_reader(data))
    schema = handle.schema_arrow
    names = schema.names
    columns = [text_field] if text_field in names else names[:1]
    if out.choice is not None:  # only the fields asked for are read
        columns += [n for n in names if n not in columns and out.choice.wanted(n)]
    left = memory_left()
    limit = expansion_limit(MAX_EXPANDED_BYTES, left)
    meta, wanted = handle.metadata, set(columns)
    pages = sum(
        chunk.total_uncompressed_size
        for r in range(meta.num_row_groups)
        for chunk in (meta.row_group(r).column(c) for c in range(meta.num_columns))
        if chunk.path_in_schema.split(".")[0] in wanted
    )
    advice = "write it with smaller row groups"
    if pages > limit:
        raise too_large(MAX_EXPANDED_BYTES, left, f"when read (its pages declare {pages})", advice)
    strings = [n for n in columns if _is_bytes(schema.field(n).type)]
    if strings:  # read as dictionaries: their expansion is counted before it is made
        handle = pq.ParquetFile(arrow_reader(data), read_dictionary=strings)
    first = expanded = 0
    for batch in handle.iter_batches(columns=columns):
        table = pa.Table.from_batches([batch])
        for column in table.columns:
            for chunk in column.chunks if pa.types.is_dictionary(column.type) else ():
                expanded += pc.sum(pc.binary_length(chunk.dictionary).take(chunk.indices)).as_py() or 0
        if expanded > limit:
            raise too_large(MAX_EXPANDED_BYTES, left, "when read (its strings repeat dictionary values)", advice)
        column_records(table.cast(pa.schema([schema.field(n) for n in table.column_names])), text_field, out, first)
        first += batch.num_rows


def _is_bytes(kind: pa.DataType) -> bool:
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or (pa.types.is_large_binary(kind))
    )
