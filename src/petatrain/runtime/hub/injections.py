"""Injected faults that fired: each fires once per run, across attempts and drivers."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class FiredInjections:
    """The keys of the injections that fired (an earlier driver's come from the ledger)."""

    def __init__(self, fired: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._fired = set(fired)

    def claim(self, key: str) -> bool:
        """True the first time `key` is claimed."""
        with self._lock:
            if key in self._fired:
                return False
            self._fired.add(key)
            return True

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._fired)
