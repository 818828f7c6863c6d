"""What an ingest is asked to do (`IngestJob`) and what it did (`IngestSummary`).

Their own module, so that the ingest stages, `--register` and the API share them without
importing one another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from petatrain.config import IngestConfig
from petatrain.storage import StorageOptions


@dataclass(kw_only=True, slots=True)
class StageProgress:
    """How far a stage is: its items (files or pieces read, shards written), the bytes and rows they
    held (bytes_total 0: not known ahead), and the seconds since the stage began."""

    items: int
    items_total: int
    rows: int
    bytes: int
    bytes_total: int
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far, by bytes where known, else by items; None before any."""
        share = self.bytes / self.bytes_total if self.bytes_total else self.items / max(self.items_total, 1)
        return self.elapsed_s * (1 - share) / share if share > 0 else None


@dataclass(kw_only=True)
class IngestSummary:
    """What one `petatrain ingest` did; `--json` prints this."""

    dataset: str
    rows_in: int = 0
    rows_out: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    exact_duplicates: int = 0
    near_duplicates: int = 0
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0
    input_bytes: int = 0
    files_new: int = 0
    files_already_ingested: int = 0
    files_split: int = 0  # files over split_size read as several pieces in parallel
    pieces: int = 0  # first-stage tasks: one per file read whole, one per piece of a split file
    files_removed: int = 0  # --register --refresh: indexed files no longer in the folder
    files_changed: int = 0  # --register --refresh: indexed files rewritten in place
    tokens: int = 0
    tokens_left_over: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class IngestJob:
    sources: list[str]
    out: str
    config: IngestConfig = field(default_factory=IngestConfig)
    append: bool = False
    register: bool = False
    refresh: bool = False  # with register: the index becomes exactly the sources' current files
    # Starts or joins the Ray cluster the job's Ray tasks run on (api.ingest passes
    # runtime.cluster.init_ray for --address); None: a Ray this process started already, or Ray's default.
    connect: Callable[[], None] | None = None
    options: StorageOptions | None = None
    # Called as each stage starts ("start") and ends ("done"), for a console's progress.
    on_stage: Callable[[str, str], None] | None = None
    # Called as each piece of a stage's work finishes (a file or piece read, a shard written).
    on_progress: Callable[[str, StageProgress], None] | None = None
