"""The dataset card: `DATASET/README.md`, rewritten by every commit.

A person reads the schema, counts, lineage and tokenizer there; Hugging Face `datasets` reads
its YAML header, whose `configs`/`data_files` name the shards (`data/*.parquet`), so that
`load_dataset(DATASET)` takes them and not the index or the rejects beside them (Parquet too,
other schemas). Spark skips folders whose names start with `_` and reads `DATASET/data/`;
DuckDB reads `DATASET/data/*.parquet`.

The card is derived from the manifest and written after it: it is never the commit point, and
a card a crash left stale is rewritten by the next commit.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from petatrain.data.index import read_shard_index
from petatrain.data.manifest import Manifest
from petatrain.storage import StorageOptions, atomic_write, join

CARD = "README.md"
_LISTED_FILES = 1000  # a registered dataset's card names up to this many files, else their folder's glob
_SHOWN_BATCHES = 20


def write_card(url: str, manifest: Manifest, options: StorageOptions | None = None) -> None:
    """Write the card of the dataset at `url` as `manifest` (just committed) describes it."""
    paths = []
    if manifest.registered:  # its files are elsewhere: the card names them
        paths = read_shard_index(url, manifest, options).column("path").to_pylist()
    atomic_write(join(url, CARD), render(url, manifest, paths).encode(), options)


def data_files(manifest: Manifest, shard_paths: list[str]) -> list[str]:
    """What the card's `data_files` names: the shards petatrain wrote, or a registered dataset's files."""
    if not manifest.registered:
        return ["data/*.parquet"]
    if len(shard_paths) <= _LISTED_FILES:
        return list(shard_paths)
    common = os.path.commonpath([p.split("://", 1)[-1] for p in shard_paths])
    scheme = shard_paths[0].split("://", 1)[0] + "://" if "://" in shard_paths[0] else ""
    return [f"{scheme}{common}/**/*.parquet"]


def render(url: str, manifest: Manifest, shard_paths: list[str]) -> str:
    m, t = manifest, manifest.totals
    header: dict[str, Any] = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": data_files(m, shard_paths)}]}],
        "tags": ["petatrain"],
    }
    name = url.rstrip("/").rsplit("/", 1)[-1] or url
    lines = [
        "---",
        yaml.safe_dump(header, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {name}",
        "",
        f"A petatrain dataset ({m.kind}): {t.rows:,} rows in {t.shards:,} Parquet shards, {t.bytes:,} bytes.",
        "This card is written by petatrain at every commit; `_index/manifest.json` is the record.",
        "",
        "## Schema",
        "",
        "| column | type |",
        "| --- | --- |",
        *(f"| `{c.name}` | `{c.type}` |" for c in m.schema),
        "",
    ]
    if m.partitions:
        lines += [f"Hive partitions (values in the files' folder names): {', '.join(m.partitions)}.", ""]
    lines += [
        "## Counts",
        "",
        f"- records read: {t.rows_in:,}; rows kept: {t.rows:,} ({t.documents or t.rows:,} documents)",
        f"- rejected: {sum(t.rejected.values()):,}"
        + (f" ({', '.join(f'{k}: {v:,}' for k, v in sorted(t.rejected.items()))})" if t.rejected else "")
        + " — kept with their reasons in `_rejects/`",
        f"- exact duplicates dropped: {t.exact_duplicates:,}; near duplicates dropped: {t.near_duplicates:,}",
    ]
    if t.tokens:
        lines.append(f"- tokens: {t.tokens:,}")
    lines += [
        "",
        "## Lineage",
        "",
        f"{m.lineage.num_sources:,} source files in {len(m.lineage.batches)} batches "
        "(every file's URL, size and checksum: `_index/lineage/*.parquet`).",
        "",
        "| batch | time | files | rows |",
        "| ---: | --- | ---: | ---: |",
        *(f"| {b.batch} | {b.time} | {b.files:,} | {b.rows_out:,} |" for b in m.lineage.batches[-_SHOWN_BATCHES:]),
        "",
    ]
    if m.tokenizer:
        tok = m.tokenizer
        lines += [
            "## Tokenizer",
            "",
            f"`{tok.spec}`: {tok.vocab_size:,} ids stored as little-endian `{tok.dtype}`, end of document "
            f"{tok.eos_id}; the tokenizer is `{tok.path}`."
            + (f" Rows of {m.pack_length} tokens (`tokens`, fixed-width binary)." if m.pack_length else ""),
            "",
        ]
    if m.encryption:
        lines += ["The shards are encrypted (Parquet modular encryption): readers need the dataset's keys.", ""]
    if m.registered:
        folder = data_files(m, shard_paths)
        lines += [
            "## Reading it",
            "",
            "The rows are in the registered files, in place (the header names them):",
            "`datasets.load_dataset(THIS_FOLDER)` reads them; Spark and DuckDB read their own folder.",
            f"Files: {', '.join(folder[:3])}{' ...' if len(folder) > 3 else ''}",
            "",
        ]
        return "\n".join(lines)
    lines += [
        "## Reading it",
        "",
        "The rows are in `data/`; `_index/` and `_rejects/` hold Parquet files of other schemas.",
        "",
        "```python",
        f'datasets.load_dataset("{url}")                      # Hugging Face: this card names the files',
        f'spark.read.parquet("{url}/data/")                    # Spark skips folders starting with "_"',
        f"duckdb.sql(\"SELECT * FROM read_parquet('{url}/data/*.parquet')\")",
        f'petatrain.data.loader("{url}", columns=[...])       # exactly-once, resumable',
        "```",
        "",
    ]
    return "\n".join(lines)
