"""A dataset's manifest (`_index/manifest.json`, the commit point), as types.

Written by ingest and `--register`, read by the loader, `inspect` and training; every field a
reader relies on is checked with its type when the JSON is read (`Manifest.from_dict`), so a
damaged or hand-edited manifest is one line naming the field, not a KeyError three modules
later. `to_dict` writes the same JSON that datasets already on disk hold; fields missing from
older datasets (no checksummed `index`, no `generation`) read as their defaults.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from petatrain.errors import CorruptDataError

FORMAT = "petatrain.dataset"
# 1: shards' document id column `id`, every source's lineage in this JSON.
# 2: `doc_id` beside the sources' own fields (an append to a version-1 dataset keeps its `id`
#    layout), lineage in Parquet tables beside the index (the JSON keeps counts and pointers).
VERSION = 2


ISO_TIME = "%Y-%m-%dT%H:%M:%SZ"  # how records date themselves (UTC, to the second)


def now(at: float | None = None) -> str:
    """`at` (default: now) as records write it."""
    return time.strftime(ISO_TIME, time.gmtime(at))


def epoch(text: object) -> float | None:
    """A time `now` wrote, as seconds since the epoch; None for anything else."""
    import calendar

    try:
        return float(calendar.timegm(time.strptime(str(text), ISO_TIME)))
    except ValueError:
        return None


@dataclass(kw_only=True, slots=True)
class Totals:
    shards: int = 0
    rows: int = 0
    bytes: int = 0
    documents: int = 0
    rows_in: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    exact_duplicates: int = 0
    near_duplicates: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerInfo:
    """The dataset's tokenizer file and what the loader needs to read its ids."""

    vocab_size: int
    dtype: str = "uint16"
    path: str = "_index/tokenizer.json"
    checksum: str = ""
    spec: str = ""
    eos_id: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexFile:
    """The shard index file this manifest commits (older datasets have none: `_index/shards.parquet`)."""

    path: str
    checksum: str
    bytes: int
    sha256: str = ""  # when the manifest is signed: xxh3 is not made to resist a forger


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    url: str
    size: int
    fingerprint: str
    checksum: str
    batch: int
    file_ord: int | None = None  # registered files have none: they are not read by ingest


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    batch: int
    time: str
    files: int
    rows_out: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LineagePart:
    """One Parquet table of source rows (`lineage.LINEAGE_SCHEMA`), written by one commit."""

    path: str
    checksum: str
    bytes: int
    rows: int
    sha256: str = ""  # when the manifest is signed, as for the index


@dataclass(kw_only=True, slots=True)
class Lineage:
    """Where the dataset came from: its ingest batches, and its source files. Version-2 datasets
    keep the sources in Parquet tables (`parts`, read by `lineage.read_sources`), so the manifest
    stays small at millions of files; version 1 listed them here (`sources`)."""

    sources: list[Source] = field(default_factory=list)  # version 1 only
    batches: list[Batch] = field(default_factory=list)
    next_file_ord: int = 0
    parts: list[LineagePart] = field(default_factory=list)
    source_count: int = 0  # rows of `parts` together

    @property
    def num_sources(self) -> int:
        return self.source_count + len(self.sources)


@dataclass(kw_only=True, slots=True)
class Manifest:
    """What a committed dataset is: its shards (through `index`), schema, totals and history."""

    kind: str  # packed | tokens | text | registered
    schema: list[Column]
    totals: Totals
    lineage: Lineage
    index: IndexFile | None = None
    tokenizer: TokenizerInfo | None = None
    ingest: dict[str, Any] = field(default_factory=dict)  # the IngestConfig it was built with (and LSH parameters)
    registered: bool = False
    # Registered Hive-partitioned files: the columns (the schema's last) whose values are in the
    # files' `key=value` folder names, not in the files.
    partitions: list[str] = field(default_factory=list)
    file_bits: int | None = None
    dedup_state: list[dict[str, Any]] = field(default_factory=list)  # {path, checksum} per shard's state file
    rejects: list[dict[str, Any]] = field(default_factory=list)  # {path, batch}
    created: str = field(default_factory=now)
    updated: str = ""
    generation: int = 0  # how many commits made it: the fence of the next one
    # Parquet modular encryption: the dataset keys, wrapped (`storage.parquet_crypt.DatasetKeys.record`);
    # the shard index says which key each shard uses ("" for a plaintext shard). None: nothing encrypted.
    encryption: dict[str, Any] | None = None
    # Not in the JSON: whether a signature by the configured key was verified when this was read
    # (then the index's and every shard's SHA-256 are checked as they are read).
    signed: bool = field(default=False, compare=False)
    signed_by: str = field(default="", compare=False)  # the key id of its signature, verified or not

    @property
    def pack_length(self) -> int:
        return int(self.ingest.get("pack_length") or 0)

    def column_type(self, name: str) -> str | None:
        return next((c.type for c in self.schema if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        del values["signed"], values["signed_by"]
        if values["index"] is not None and not values["index"]["sha256"]:
            del values["index"]["sha256"]
        return {"format": FORMAT, "version": VERSION, **values}

    @classmethod
    def from_dict(cls, raw: Any) -> Manifest:
        """The manifest in `raw` (parsed JSON); CorruptDataError names the first field that is wrong."""
        if not isinstance(raw, dict):
            raise CorruptDataError(f"a {type(raw).__name__}, not a JSON object")
        for key, kind in (("totals", dict), ("schema", list), ("lineage", dict)):
            if not isinstance(raw.get(key), kind):
                raise CorruptDataError(f"missing {key!r}" if key not in raw else f"{key!r} is not a {kind.__name__}")
        totals = raw["totals"]
        for key in ("shards", "rows", "bytes"):
            if not _count(totals.get(key)):
                raise CorruptDataError(f"totals.{key} is {totals.get(key)!r}, not a count")
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in raw["schema"]):
            raise CorruptDataError("schema is not a list of {name, type} columns")
        lineage = raw["lineage"]
        if not all(isinstance(lineage.get(key, []), list) for key in ("sources", "batches", "parts")):
            raise CorruptDataError("lineage.sources, lineage.batches and lineage.parts must be lists")
        tokenizer = raw.get("tokenizer")
        if tokenizer is not None and not (isinstance(tokenizer, dict) and _count(tokenizer.get("vocab_size"))):
            raise CorruptDataError(f"tokenizer {str(tokenizer)[:80]} has no vocab_size")
        index = raw.get("index")
        if index is not None and not (isinstance(index, dict) and isinstance(index.get("path"), str)):
            raise CorruptDataError(f"index {str(index)[:80]} names no file")
        try:
            return cls(
                kind=str(raw.get("kind", "")),
                schema=[Column(str(c["name"]), str(c.get("type", ""))) for c in raw["schema"]],
                totals=_build(Totals, totals),
                lineage=Lineage(
                    sources=[_build(Source, s) for s in lineage.get("sources", [])],
                    batches=[_build(Batch, b) for b in lineage.get("batches", [])],
                    next_file_ord=int(lineage.get("next_file_ord", 0)),
                    parts=[_build(LineagePart, p) for p in lineage.get("parts", [])],
                    source_count=int(lineage.get("source_count", 0)),
                ),
                index=_build(IndexFile, index) if index else None,
                tokenizer=_build(TokenizerInfo, tokenizer) if tokenizer else None,
                ingest=dict(raw.get("ingest") or {}),
                registered=bool(raw.get("registered", False)),
                partitions=[str(p) for p in raw.get("partitions", [])],
                file_bits=raw.get("file_bits"),
                dedup_state=list(raw.get("dedup_state", [])),
                rejects=list(raw.get("rejects", [])),
                created=str(raw.get("created", "")),
                updated=str(raw.get("updated", "")),
                generation=int(raw.get("generation", 0)),
                encryption=_encryption(raw.get("encryption")),
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise CorruptDataError(f"a field has the wrong shape ({exc})") from None


def _encryption(raw: Any) -> dict[str, Any] | None:
    if raw is not None and not (isinstance(raw, dict) and isinstance(raw.get("keys"), dict)):
        raise CorruptDataError(f"encryption {str(raw)[:80]} is not a record of dataset keys")
    return raw


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _build(kind: Any, raw: Any) -> Any:
    """A dataclass from a JSON object, keeping only the fields it declares (raises TypeError on a missing one)."""
    if not isinstance(raw, dict):
        raise TypeError(f"{kind.__name__.lower()} {str(raw)[:60]} is not an object")
    names = {f.name for f in dataclasses.fields(kind)}
    return kind(**{k: v for k, v in raw.items() if k in names})
