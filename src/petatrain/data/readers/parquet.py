"""Parquet: a row is a record, the text in column `text_field`; only the columns asked for are read."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from petatrain.data.buffers import arrow_reader
from petatrain.data.readers.base import FileRecords, column_records


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    handle = pq.ParquetFile(arrow_reader(data))
    names = handle.schema_arrow.names
    columns = [text_field] if text_field in names else names[:1]
    if out.choice is not None:  # only the fields asked for are read
        columns += [n for n in names if n not in columns and out.choice.wanted(n)]
    first = 0
    for batch in handle.iter_batches(columns=columns):
        column_records(pa.Table.from_batches([batch]), text_field, out, first)
        first += batch.num_rows
