"""Calibrations written by `petatrain profile` and read by `petatrain plan`: one small JSON per accelerator."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from petatrain import constants
from petatrain.errors import PetatrainError


@dataclass(kw_only=True, slots=True)
class Calibration:
    """What a measured run taught us about one accelerator."""

    accelerator: str  # catalog name, or "cpu"
    efficiency: float  # executed FLOP/s over the peak the plan uses (hardware FLOPs utilisation)
    mfu: float  # model FLOPs utilisation of the profiled run
    peak_flops: float  # the peak efficiency is relative to
    overhead_s: float  # per step, outside forward/backward/optimizer (data wait, host work)
    steps: int
    measured_at: str
    config: dict
    spread: float = 0.0  # interquartile range of the timed steps over their median (0: not recorded)
    # Bus bandwidth (bytes/s over each rank's link, as a ring counts them) the tensor-parallel
    # collectives achieved in `profile` with parallel.tensor > 1; 0: not measured (the catalog's link).
    tensor_bus_bandwidth: float = 0.0
    path: str = ""  # where it was read from (not written in the file)

    def describe(self) -> str:
        """Where an estimate calibrated by it comes from, for people."""
        spread = f", spread {self.spread:.0%}" if self.spread else ""
        return f"{self.path or 'a calibration'} (measured {self.measured_at}, {self.steps} steps{spread})"

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}


def calibration_dir(configured: str = "") -> Path:
    return Path(
        configured or os.environ.get(constants.CALIBRATION_DIR_ENV) or "~/.cache/petatrain/calibration"
    ).expanduser()


def _file_name(accelerator: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in accelerator) + ".json"


def save_calibration(cal: Calibration, configured_dir: str = "") -> Path:
    folder = calibration_dir(configured_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _file_name(cal.accelerator)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def load_calibrations(configured_dir: str = "") -> dict[str, Calibration]:
    """Every calibration in the folder by accelerator name; an unreadable file is an error naming it."""
    folder = calibration_dir(configured_dir)
    out: dict[str, Calibration] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            cal = dataclasses.replace(Calibration(**json.loads(path.read_text())), path=str(path))
        except (ValueError, TypeError) as exc:
            raise PetatrainError(f"calibration {path} is unreadable ({exc}); delete it or run profile again") from None
        if not 0 < cal.efficiency <= 1:
            raise PetatrainError(f"calibration {path}: efficiency {cal.efficiency} is not in (0, 1]")
        out[cal.accelerator] = cal
    return out
