"""`petatrain dataset gc`: remove old versions of a dataset, never one still in use.

A version is its record (`_index/versions/vN.json`) and the shard index file it names; its shards
are shared with every later version (an append only adds shards), so nothing else is removed. The
latest `keep` versions stay, and so does every version something still names: a run's pinned
`data.dataset` (`DATASET@vN` in its `config.yaml`, under the run folders given), a registry
version's record (its `dataset`). gc takes the dataset's lease, so it never runs beside an append
(one line says which writer holds it); a reader that opened a version before has its index in
memory and reads the shards, which stay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from petatrain.data import index as idx
from petatrain.errors import ConfigError, PetatrainError
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import exists, read_bytes, remove_tree, resolve, to_url
from petatrain.storage.lock import LEASE_FILE, Lease, LeaseHeld

log = logging.getLogger(__name__)


def users(root: str, runs: Iterable[str], registry: Any, options: StorageOptions | None) -> dict[int, list[str]]:
    """{version: [who names it]} of the dataset at `root`: runs under the `runs` folders (each
    child's config.yaml), and the registry's versions (`registry`: a registry.store.Registry)."""
    import yaml

    named: dict[int, list[str]] = {}

    def note(dataset: object, who: str) -> None:
        if not isinstance(dataset, str):
            return
        found_root, version = idx.split_version(dataset)
        if version is not None and _same(found_root, root):
            named.setdefault(version, []).append(who)

    for folder in runs:
        fs, path = resolve(folder, options)
        try:
            children = fs.ls(path, detail=False)
        except FileNotFoundError:
            continue
        for child in sorted(children):
            url = to_url(fs, child)
            config = join(url, "config.yaml")
            if not exists(config, options):
                continue
            try:
                data = (yaml.safe_load(read_bytes(config, options)) or {}).get("data") or {}
            except (yaml.YAMLError, AttributeError, OSError):
                continue
            note(data.get("dataset"), f"run {url}")
    if registry is not None:
        for name in registry.models():
            for version in registry.versions(name):
                try:
                    record = registry.record(name, version)
                except PetatrainError:
                    continue
                note(record.get("dataset"), f"registry://{name}@{version}")
    return named


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def collect(url: str, keep: int, in_use: dict[int, list[str]], options: StorageOptions | None = None) -> dict[str, Any]:
    """Remove the versions of `url` older than its latest `keep` that nothing in `in_use` names;
    {"removed", "kept", "in_use": {version: [who]}} (only the versions kept because of them)."""
    if keep < 1:
        raise ConfigError(f"--keep {keep}: at least the latest version is kept (--keep >= 1)")
    root = idx.split_version(url)[0]
    if idx.read_manifest(root, options) is None:
        raise PetatrainError(f"no dataset at {root}")
    try:
        lease = Lease(join(root, LEASE_FILE), kind="gc", what=root, options=options)
        lease.acquire()
    except LeaseHeld as held:
        raise PetatrainError(f"{root}: not now, a writer holds it ({held})") from None
    try:
        numbers = idx.version_numbers(root, options)
        newest = set(numbers[-keep:])
        removed = [v for v in numbers if v not in newest and v not in in_use]
        held_for = {v: who for v, who in sorted(in_use.items()) if v in numbers and v not in newest}
        for version in removed:
            lease.check()
            remove_tree(join(root, idx.version_path(version)), options)
        manifest = idx.read_manifest(root, options)
        if manifest is not None:
            idx.remove_old_indexes(root, manifest, None, options)  # the index files no kept version names
    finally:
        lease.release()
    if removed:
        log.info("%s: removed versions %s", root, ", ".join(f"v{v}" for v in removed))
    return {
        "dataset": root,
        "removed": removed,
        "kept": [v for v in numbers if v not in removed],
        "in_use": {str(v): who for v, who in held_for.items()},
    }
