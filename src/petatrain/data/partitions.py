"""Hive-style partitions: the `key=value` folder names Spark's `partitionBy` writes.

Spark keeps a partition column's values only in the folder names (`src=web/part-0.parquet`);
petatrain recovers them as columns, typed as Spark infers them (integers as int64, the rest
as strings), whether it ingests the files or registers them in place.
"""

from __future__ import annotations

import re
import urllib.parse

import pyarrow as pa

from petatrain.errors import PetatrainError

_INTEGER = re.compile(r"-?[0-9]{1,18}")
_NULL = "__HIVE_DEFAULT_PARTITION__"  # Spark's folder name for a null value


def hive_partitions(url: str, root: str = "") -> dict[str, str | None]:
    """The `key=value` folders of the file `url` below `root` (the folder or glob base it was found
    under; "" takes every folder), decoded as Spark writes them (%XX escapes)."""
    if root and not url.startswith(root):
        return {}
    found: dict[str, str | None] = {}
    for segment in url[len(root) :].split("/")[:-1]:
        key, sep, value = segment.partition("=")
        if sep and key and "://" not in segment:
            value, key = urllib.parse.unquote(value), urllib.parse.unquote(key)
            if key in found:  # Spark refuses it too ("conflicting partition column names")
                raise PetatrainError(f"{url}: the partition column {key!r} appears twice in its folders")
            found[key] = None if value == _NULL else value
    return found


def partition_type(values: list[str | None]) -> pa.DataType:
    """int64 when every value is an integer (nulls aside), else a string."""
    known = [v for v in values if v is not None]
    return pa.int64() if known and all(_INTEGER.fullmatch(v) for v in known) else pa.large_string()


def partition_array(value: str | None, n: int, kind: pa.DataType | None = None) -> pa.Array:
    """One file's partition value as a column of `n` rows, of type `kind` (default: as `partition_type`)."""
    kind = kind or partition_type([value])
    if value is None:
        return pa.nulls(n, kind)
    return pa.array([int(value) if pa.types.is_integer(kind) else value] * n, kind)
