"""A run's final weights, `RUN/final/model.safetensors`, and the record that commits them.

RUN/final/
    model.safetensors   the whole model's weights by parameter name (rank 0 writes them)
    COMMITTED           written after them: {"file", "bytes", "checksum" (xxh3-128), "step", "format"}

A reader (`serve`) trusts the weights only if the record is there and they match it: a run whose
driver died while writing them, or a file changed since, is refused with one line naming it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from petatrain.errors import CorruptDataError
from petatrain.storage import StorageOptions, join
from petatrain.storage.checksum import checksum_bytes, verify
from petatrain.storage.fs import atomic_write, exists, read_bytes

WEIGHTS = "model.safetensors"
RECORD = "COMMITTED"
FORMAT = 1


def final_dir(run_url: str) -> str:
    return join(run_url, "final")


def write_final(run_url: str, data: bytes, step: int, options: StorageOptions | None = None) -> dict[str, Any]:
    """The weights (safetensors bytes), then their record; returns the record."""
    folder = final_dir(run_url)
    atomic_write(join(folder, WEIGHTS), data, options)
    record = {"file": WEIGHTS, "bytes": len(data), "checksum": checksum_bytes(data), "step": step, "format": FORMAT}
    atomic_write(join(folder, RECORD), json.dumps(record).encode(), options)
    return record


def read_final(run_url: str, options: StorageOptions | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, record) of a run's committed final weights; CorruptDataError naming the file otherwise."""
    from safetensors.torch import load

    folder = final_dir(run_url)
    weights, marker = join(folder, WEIGHTS), join(folder, RECORD)
    if not exists(marker, options):
        raise CorruptDataError(
            f"{weights} was never committed (no {RECORD} beside it: the run has not finished, its driver died "
            "while writing them, or an older petatrain wrote them); serve a checkpoint instead (--checkpoint latest)"
        )
    try:
        record = json.loads(read_bytes(marker, options))
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("file") != WEIGHTS:
            raise ValueError(f"{RECORD} is not a record of {WEIGHTS}")
        data = read_bytes(weights, options)
        if len(data) != record.get("bytes"):
            raise ValueError(f"{len(data)} bytes, {record.get('bytes')} recorded")
        verify(data, str(record.get("checksum")), weights)
        return load(data), record
    except (OSError, ValueError) as exc:
        raise CorruptDataError(f"{weights} does not verify: {exc}") from None
