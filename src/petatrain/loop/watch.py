"""The loop's watcher: which files under the source are new to the dataset and finished.

A file is new while the dataset's lineage does not name its URL. It is taken once it is stable:
the same size and identity (ETag or mtime) at two looks, so a file still being written (or copied
in parts) is left for a later cycle; it is then quarantined record by record, as ingest does, if
it is malformed. A file the dataset already holds that has changed since is not new data (ingest
would refuse it): it is reported and left alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from petatrain.data import lineage
from petatrain.data.index import read_manifest
from petatrain.storage.fs import SourceFile, StorageOptions, expand_sources


@dataclass(slots=True)
class Look:
    """What one look at the source found."""

    ready: list[SourceFile]  # stable new files, when they are enough to start a cycle; else []
    stable: list[SourceFile]  # new files unchanged since the previous look
    settling: list[SourceFile]  # new files seen for the first time or changed since: look again
    changed: list[str] = field(default_factory=list)  # files the dataset holds that have changed since
    waited_s: float = 0.0  # since the oldest stable new file was first seen

    @property
    def new_bytes(self) -> int:
        return sum(f.size for f in self.stable)


class Watcher:
    """Looks at `source` for files new to `dataset`; remembers the previous look (in memory: a
    restarted loop looks twice before it takes a file, as a first start does)."""

    def __init__(
        self,
        source: str,
        dataset: str,
        options: StorageOptions | None = None,
        *,
        min_bytes: int = 0,
        max_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source, self.dataset, self.options = source, dataset, options
        self.min_bytes, self.max_wait_s, self.clock = min_bytes, max_wait_s, clock
        self._previous: dict[str, tuple[int, str]] = {}
        self._first_seen: dict[str, float] = {}
        self._sources: tuple[int, dict[str, int]] = (0, {})  # the dataset's sources, by its version

    def look(self) -> Look:
        now = self.clock()
        listed = expand_sources([self.source], self.options, allow_empty=True)
        known = self._known()
        new = [f for f in listed if f.url not in known]
        changed = [f.url for f in listed if f.url in known and known[f.url] != f.size]
        stable = [f for f in new if self._previous.get(f.url) == (f.size, f.fingerprint)]
        settling = [f for f in new if self._previous.get(f.url) != (f.size, f.fingerprint)]
        self._previous = {f.url: (f.size, f.fingerprint) for f in new}
        self._first_seen = {f.url: self._first_seen.get(f.url, now) for f in new}
        waited = now - min((self._first_seen[f.url] for f in stable), default=now)
        enough = sum(f.size for f in stable) >= self.min_bytes or (self.max_wait_s > 0 and waited >= self.max_wait_s)
        return Look(
            ready=stable if stable and enough else [],
            stable=stable,
            settling=settling,
            changed=changed,
            waited_s=round(waited, 3),
        )

    def _known(self) -> dict[str, int]:
        """The dataset's sources: URL -> size when ingested ({} before the first commit). Its lineage
        is read again only when a commit made a new version, not at every look."""
        manifest = read_manifest(self.dataset, self.options)
        if manifest is None:
            return {}
        if self._sources[0] != manifest.generation:
            table = lineage.read_sources(self.dataset, manifest, self.options, columns=["url", "size"])
            known = dict(zip(table.column("url").to_pylist(), table.column("size").to_pylist(), strict=True))
            self._sources = (manifest.generation, known)
        return self._sources[1]
