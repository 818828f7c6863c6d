"""The model registry of record, on the object store: named models, their numbered versions, and
the aliases (`champion`) that promotions move and serving follows.

    REGISTRY/NAME/versions/v00000003.json   version 3's record, written once, never changed
    REGISTRY/NAME/aliases/champion.json     {"version": 3, "history": [1, 2], ...}, moved by promote/rollback
    REGISTRY/NAME/_events/e00000004.json    the 4th move of an alias: model.promoted or model.rolled_back
    REGISTRY/NAME/_lock                     the lease that serialises promotions of NAME

A record names the run, its checkpoint (`final` or a step) and the weights' checksum, its lineage
and its evaluation; it carries a SHA-256 digest of its content and, where signing is configured
(`storage.signing`), an Ed25519 signature: what serving verifies before it loads a version. A
record is complete before any alias names it (the alias moves last, in one atomic write), so a
promotion killed between the two leaves a version nobody serves, never an alias naming half a
record. Two promotions at once: the lease lets one through, the other is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from petatrain import constants
from petatrain.errors import ConfigError, CorruptDataError, PetatrainError
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, exists, is_local, numbered, read_bytes, resolve
from petatrain.storage.lock import Lease, LeaseHeld

log = logging.getLogger(__name__)

DEFAULT_REGISTRY = ".petatrain/registry"
SCHEME = "registry://"
FORMAT = "petatrain-model"
DEFAULT_ALIAS = "champion"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RESERVED = ("format", "name", "version", "created", "digest", "signature")  # the registry's own fields


def registry_url(given: str | None = None) -> str:
    """--registry URL, else $PETATRAIN_REGISTRY, else .petatrain/registry (absolute where local)."""
    url = given or os.environ.get(constants.REGISTRY_ENV) or DEFAULT_REGISTRY
    return os.path.abspath(url) if is_local(url) and "://" not in url else url


def check_name(name: str, what: str = "model name") -> str:
    if not _NAME.fullmatch(name or ""):
        raise ConfigError(f"{what} {name!r}: letters, digits, '.', '_' and '-', starting with a letter or digit")
    return name


@dataclass(frozen=True, slots=True)
class ModelRef:
    """`registry://NAME@champion`, `registry://NAME@3` (or `NAME@v3`), or a run (`checkpoint` of it)."""

    name: str | None  # None: a run
    selector: str  # an alias, or a version number as text; for a run: the checkpoint ("final", "latest", STEP)
    run: str | None = None

    @property
    def is_registry(self) -> bool:
        return self.name is not None

    def __str__(self) -> str:
        return f"{SCHEME}{self.name}@{self.selector}" if self.name else f"{self.run}"


def parse_ref(text: str, checkpoint: str = "final") -> ModelRef:
    """A model reference as `evaluate`, `serve` and `promote` take it; ConfigError for a bad one."""
    if not text.startswith(SCHEME):
        return ModelRef(name=None, selector=checkpoint, run=text)
    body = text[len(SCHEME) :]
    name, _, selector = body.partition("@")
    selector = selector or DEFAULT_ALIAS
    check_name(name)
    if selector.lower().startswith("v") and selector[1:].isdigit():
        selector = selector[1:]
    if not (selector.isdigit() or _NAME.fullmatch(selector)):
        raise ConfigError(f"{text}: @ takes an alias (@champion) or a version number (@3)")
    return ModelRef(name=name, selector=str(int(selector)) if selector.isdigit() else selector)


def _digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k not in ("digest", "signature")}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Registry:
    """One registry (a folder or bucket prefix). Every read checks what it reads."""

    def __init__(self, url: str | None = None, options: StorageOptions | None = None):
        self.url = registry_url(url)
        self.options = options

    # -- paths ---------------------------------------------------------------------------------
    def _model(self, name: str) -> str:
        return join(self.url, check_name(name))

    def _version_path(self, name: str, version: int) -> str:
        return join(self._model(name), "versions", f"v{version:08d}.json")

    def _alias_path(self, name: str, alias: str) -> str:
        return join(self._model(name), "aliases", f"{check_name(alias, 'alias')}.json")

    def _event_path(self, name: str, sequence: int) -> str:
        return join(self._model(name), "_events", f"e{sequence:08d}.json")

    # -- reading -------------------------------------------------------------------------------
    def models(self) -> list[str]:
        fs, path = resolve(self.url, self.options)
        try:
            names = fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(n for n in (x.rstrip("/").rsplit("/", 1)[-1] for x in names) if _NAME.fullmatch(n))

    def promotions_of(self, runs: set[str]) -> dict[str, list[str]]:
        """{run: ["NAME@vN", ...]}: the versions whose records name one of `runs`."""
        found: dict[str, list[str]] = {}
        for name in self.models():
            for version in self.versions(name):
                try:
                    run = str(self.record(name, version).get("run"))
                except PetatrainError:
                    continue  # a record that does not verify names nothing
                if run in runs:
                    found.setdefault(run, []).append(f"{name}@v{version}")
        return found

    def versions(self, name: str) -> list[int]:
        return numbered(join(self._model(name), "versions"), "v", self.options)

    def events(self, name: str, after: int = 0) -> list[dict[str, Any]]:
        """`name`'s alias moves after the `after`-th, oldest first: model.promoted (a promotion) and
        model.rolled_back events, each numbered (`sequence`) and checked as every record is."""
        sequences = [n for n in numbered(join(self._model(name), "_events"), "e", self.options) if n > after]
        return [self._read_checked(self._event_path(name, n)) for n in sequences]

    def record(self, name: str, version: int) -> dict[str, Any]:
        """Version `version` of `name`, its digest (and signature, where a key verifies) checked."""
        where = self._version_path(name, version)
        if not exists(where, self.options):
            held = ", ".join(f"v{v}" for v in self.versions(name)) or "none"
            raise PetatrainError(f"{SCHEME}{name}@{version}: no such version in {self.url} (versions: {held})")
        record = self._read_checked(where)
        if record.get("format") != FORMAT or record.get("name") != name or record.get("version") != version:
            raise CorruptDataError(f"{where}: not the record of {name} version {version}")
        return record

    def alias(self, name: str, alias: str = DEFAULT_ALIAS) -> dict[str, Any] | None:
        where = self._alias_path(name, alias)
        if not exists(where, self.options):
            return None
        record = self._read_checked(where)
        if record.get("name") != name or record.get("alias") != alias or not isinstance(record.get("version"), int):
            raise CorruptDataError(f"{where}: not the {alias} alias of {name}")
        return record

    def resolve(self, ref: ModelRef) -> dict[str, Any]:
        """The record a registry reference names (an alias through its current version)."""
        assert ref.name is not None
        if ref.selector.isdigit():
            return self.record(ref.name, int(ref.selector))
        moved = self.alias(ref.name, ref.selector)
        if moved is None:
            known = ", ".join(f"v{v}" for v in self.versions(ref.name))
            raise PetatrainError(
                f"{ref}: {ref.name} has no alias {ref.selector!r} in {self.url}"
                + (f" (versions: {known})" if known else " (no version promoted)")
            )
        return self.record(ref.name, int(moved["version"]))

    def _read_checked(self, where: str) -> dict[str, Any]:
        from petatrain.security import signing

        try:
            record = json.loads(read_bytes(where, self.options))
        except (ValueError, UnicodeDecodeError):
            raise CorruptDataError(f"{where}: not a JSON registry record") from None
        if not isinstance(record, dict) or record.get("digest") != _digest(record):
            raise CorruptDataError(f"{where}: its digest does not match its content (tampered or damaged)")
        signing.check(self.options, signing.canonical(record), record.get("signature"), where)
        return record

    # -- writing -------------------------------------------------------------------------------
    def _write(self, where: str, record: dict[str, Any]) -> None:
        from petatrain.security import signing

        record = {k: v for k, v in record.items() if k not in ("digest", "signature")}
        record["digest"] = _digest(record)
        signature = signing.sign(self.options, signing.canonical(record))
        if signature is not None:
            record["signature"] = signature
        atomic_write(where, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), self.options)

    def _lease(self, name: str, what: str) -> Lease:
        lease = Lease(join(self._model(name), "_lock"), kind=what, what=f"{SCHEME}{name}", options=self.options)
        try:
            lease.acquire()
        except LeaseHeld as held:
            raise PetatrainError(f"{SCHEME}{name}: another promotion or rollback is under way ({held})") from None
        return lease

    def find(self, name: str, fields: dict[str, Any], alias: str = DEFAULT_ALIAS) -> dict[str, Any] | None:
        """The version of `name` that records the weights `fields` names (the same run, checkpoint and
        checksum) among those a retried promotion may have left: the one `alias` names and any written
        after it (a promotion killed before its alias moved). None if none does: promoting weights an
        older version holds is a new promotion, with its own evaluation."""
        wanted = (fields.get("run"), str(fields.get("checkpoint")), fields.get("checksum"))
        current = self.alias(name, alias)
        since = int(current["version"]) if current else 0
        for version in reversed([v for v in self.versions(name) if v >= since]):
            record = self.record(name, version)
            if (record.get("run"), str(record.get("checkpoint")), record.get("checksum")) == wanted:
                return record
        return None

    def register(self, name: str, fields: dict[str, Any], alias: str | None = DEFAULT_ALIAS) -> dict[str, Any]:
        """Write the next version of `name` from `fields` (run, checkpoint, checksum, lineage, eval),
        then move `alias` to it; under the model's lease. The new record.

        Idempotent: weights that already are a version (a retried promotion, one killed between its
        record and the alias) are not registered twice; the alias is moved to that version if it
        does not name it, and its record returned."""
        lease = self._lease(name, "promote")
        try:
            existing = self.find(name, fields, alias or DEFAULT_ALIAS)
            if existing is not None:
                current = self.alias(name, alias) if alias else None
                if alias and (current is None or current["version"] != existing["version"]):
                    moved = self._move(name, alias, int(existing["version"]), lease)
                    self._event(name, "model.promoted", moved, existing, lease)
                return existing
            version = max(self.versions(name), default=0) + 1
            given = {k: v for k, v in fields.items() if k not in _RESERVED}
            record = {**given, "format": FORMAT, "name": name, "version": version, "created": _now()}
            lease.check()
            self._write(self._version_path(name, version), record)
            if alias:
                moved = self._move(name, alias, version, lease)
                self._event(name, "model.promoted", moved, self.record(name, version), lease)
            return self.record(name, version)
        finally:
            lease.release()

    def rollback(self, name: str, alias: str = DEFAULT_ALIAS) -> dict[str, Any]:
        """Move `alias` back to the version it named before; the alias record."""
        lease = self._lease(name, "rollback")
        try:
            current = self.alias(name, alias)
            if current is None or not current.get("history"):
                raise PetatrainError(f"{SCHEME}{name}@{alias}: nothing to roll back to (no earlier version held it)")
            history = list(current["history"])
            back = int(history.pop())
            back_to = self.record(name, back)  # it must still verify
            moved = self._write_alias(name, alias, back, history, lease)
            self._event(name, "model.rolled_back", {**moved, "from": current["version"]}, back_to, lease)
            return moved
        finally:
            lease.release()

    def _move(self, name: str, alias: str, version: int, lease: Lease) -> dict[str, Any]:
        current = self.alias(name, alias)
        history = [*current.get("history", []), current["version"]] if current else []
        return self._write_alias(name, alias, version, history, lease)

    def _event(self, name: str, kind: str, moved: dict[str, Any], record: dict[str, Any], lease: Lease) -> None:
        """Append `kind` to the model's event log, numbered after the last (under the model's lease).
        The alias has moved: a failed write is a warning (the alias record is the truth)."""
        sequence = max(numbered(join(self._model(name), "_events"), "e", self.options), default=0) + 1
        event = {
            "event": kind,
            "sequence": sequence,
            "model": name,
            "alias": moved["alias"],
            "version": moved["version"],
            "from": moved.get("from", moved["history"][-1] if moved.get("history") else None),
            "time": moved["moved"],
            "run": record.get("run"),
            "checkpoint": record.get("checkpoint"),
            "checksum": record.get("checksum"),
            "dataset": record.get("dataset"),
            "record_digest": record["digest"],
        }
        try:
            lease.check()
            self._write(self._event_path(name, sequence), event)
        except Exception as exc:
            log.warning("%s%s@%s moved to v%d; its %s event was not written (%s)", SCHEME, name, moved["alias"],
                        moved["version"], kind, exc)  # fmt: skip

    def _write_alias(self, name: str, alias: str, version: int, history: list[int], lease: Lease) -> dict[str, Any]:
        record = {"name": name, "alias": alias, "version": version, "history": history, "moved": _now()}
        lease.check()
        self._write(self._alias_path(name, alias), record)
        moved = self.alias(name, alias)
        assert moved is not None
        return moved


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
