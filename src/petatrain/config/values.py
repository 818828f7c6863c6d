"""Values a config spells as text: sizes ("256MB", "1GiB")."""

from __future__ import annotations

from petatrain.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int, key: str = "size") -> int:
    """'256MB' -> 256_000_000; plain integers are bytes."""
    if isinstance(text, int):
        value = text
    else:
        raw = str(text).strip().upper().replace(" ", "")
        number = raw.rstrip("KMGTIB")
        unit = raw[len(number) :]
        try:
            value = int(float(number) * _SIZE_UNITS[unit])
        except (ValueError, KeyError):
            raise ConfigError(f"{key}: cannot read size {text!r} (try 256MB or 1GiB)") from None
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {text!r}")
    return value
