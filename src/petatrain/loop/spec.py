"""`LOOP.yaml`: what `petatrain loop` keeps current, where its data comes from and when a cycle runs.

    model: tiny                         # the registered model the loop promotes
    job: examples/tiny.yaml             # the job config of its runs (model, train, ingest, promote)
    set: [parallel.workers=1]           # --set overrides of that config
    source: incoming/                   # where new files land: a folder, prefix or glob
    dataset: .petatrain/datasets/loop   # the dataset they are appended to (data.dataset of the runs)
    runs: .petatrain/loops/tiny         # the first run, its continuations, the loop's records
    steps: 40                           # steps of the first run (from scratch); each later cycle
                                        # trains its carry-over pass: every new row once, plus replay
    watch: {poll_s: 30, settle_s: 5, min_bytes: 0, max_wait_s: 0}

Paths are relative to the working directory, as in a job config. Unknown keys and bad values are
one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petatrain import config as config_mod
from petatrain.config import JobConfig
from petatrain.errors import ConfigError
from petatrain.storage.fs import is_local, join

STATE_FOLDER = "_loop"  # under `runs`: the loop's lease and its cycle records


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    """When new files start a cycle. A file is taken once it is stable: the same size and identity
    (ETag, mtime) at two looks `settle_s` apart, so one still being written is left for later. A
    cycle starts when the stable new files hold `min_bytes` (0: any), or when the oldest of them has
    waited `max_wait_s` (0: no limit on the wait); the source is looked at every `poll_s`."""

    poll_s: float = 30.0
    settle_s: float = 5.0
    min_bytes: str = "0"
    max_wait_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("poll_s", "settle_s", "max_wait_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"watch.{key} must be a number of seconds >= 0, got {value}")
        if self.poll_s <= 0:
            raise ConfigError(f"watch.poll_s must be > 0 seconds, got {self.poll_s}")
        _ = self.min_size

    @property
    def min_size(self) -> int:
        """watch.min_bytes in bytes (0: any new file is enough)."""
        if str(self.min_bytes).strip() in ("0", ""):
            return 0
        return config_mod.parse_size(self.min_bytes, "watch.min_bytes")


@dataclass(kw_only=True, slots=True)
class LoopSpec:
    model: str
    source: str
    dataset: str
    job: str = ""  # "" = petatrain's defaults
    set: list[str] = field(default_factory=list)
    runs: str = ""  # "" = .petatrain/loops/MODEL
    steps: int = 0  # the first run's steps; 0 = the job config's train.steps
    registry: str = ""  # "" = the job config's promote.registry, else $PETATRAIN_REGISTRY, else .petatrain/registry
    watch: WatchConfig = field(default_factory=WatchConfig)

    def __post_init__(self) -> None:
        from petatrain.registry.store import check_name

        for key in ("model", "source", "dataset"):
            if not getattr(self, key):
                raise ConfigError(f"loop: {key} is required (see petatrain loop --help)")
        check_name(self.model)
        if not isinstance(self.set, list) or not all(isinstance(item, str) for item in self.set):
            raise ConfigError("loop: set is a list of KEY=VALUE overrides of the job config, e.g. [train.lr=0.001]")
        if self.steps < 0:
            raise ConfigError(f"loop: steps must be >= 1 (0: the job config's train.steps), got {self.steps}")
        if "@" in self.dataset.rpartition("/")[2]:
            raise ConfigError(f"loop: dataset {self.dataset!r} names a version; the loop appends to the dataset itself")
        if not self.runs:
            self.runs = join(".petatrain", "loops", self.model)
        # Local paths absolute, as a run records its dataset: the loop compares them with the registry's.
        self.source, self.dataset, self.runs = (_absolute(u) for u in (self.source, self.dataset, self.runs))

    @property
    def state(self) -> str:
        """Where the loop's lease and records are."""
        return join(self.runs, STATE_FOLDER)

    def job_config(self) -> JobConfig:
        """The job config of the loop's runs: the file, the overrides, the loop's dataset."""
        return config_mod.load(self.job or None, [*self.set, f"data.dataset={self.dataset}"])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _absolute(url: str) -> str:
    return os.path.abspath(url) if is_local(url) and not url.startswith("file://") else url


def load(path: str | Path, overrides: list[str] | None = None) -> LoopSpec:
    """A loop spec from its YAML file and `--set` overrides (of the loop's own keys)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"loop file not found: {path}") from None
    values = config_mod.read_yaml(text, f"loop file {path}") or {}
    if not isinstance(values, dict):
        raise ConfigError(f"loop file {path}: expected a mapping of keys (model, job, source, dataset, ...)")
    values = config_mod.apply_overrides(values, overrides or [])
    spec: LoopSpec = config_mod.build(LoopSpec, values)
    spec.job_config()  # a bad job config or override is refused now, not at the first cycle
    return spec
