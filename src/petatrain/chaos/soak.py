"""Soak mode: a random fault every interval for a duration."""

from __future__ import annotations

import random

from petatrain.errors import ConfigError

SOAK_KINDS = ("kill", "raise", "hang", "preempt", "storage", "nan")


def parse_duration(text: str, what: str) -> float:
    """'120s', '20m', '1h' or plain seconds."""
    raw = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(raw[-1:])
    try:
        return float(raw[:-1]) * scale if scale else float(raw)
    except ValueError:
        raise ConfigError(f"{what}: cannot read {text!r} (try 120s, 20m or 1h)") from None


def soak_injections(every: str, duration: str, *, seed: int, workers: int) -> list[str]:
    """Injection specs at every, 2*every, ... < duration, with random kinds and ranks."""
    if not (every and duration):
        raise ConfigError("soak mode needs both --every and --for, e.g. --every 120s --for 20m")
    step, total = parse_duration(every, "--every"), parse_duration(duration, "--for")
    if step <= 0 or total <= step:
        raise ConfigError("--every must be positive and shorter than --for")
    rng = random.Random(seed)
    specs, t = [], step
    while t < total:
        specs.append(f"{rng.choice(SOAK_KINDS)}@t={t:g},rank={rng.randrange(workers)}")
        t += step
    return specs
