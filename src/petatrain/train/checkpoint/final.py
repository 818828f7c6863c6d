"""A run's final weights, `RUN/final/model.safetensors`, and the record that commits them.

RUN/final/
    model.safetensors   the whole model's weights by parameter name (rank 0 writes them)
    COMMITTED           written after them: {"file", "bytes", "checksum" (xxh3-128), "step", "format"},
                        and "encryption" (the wrapped data key) when the run is encrypted, "sha256"
                        and "signature" when it is signed

A reader (`serve`) trusts the weights only if the record is there and they match it: a run whose
driver died while writing them, or a file changed since, is refused with one line naming it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from petatrain.errors import CorruptDataError
from petatrain.security import signing
from petatrain.security.keys import encryption_keys
from petatrain.security.sealed import data_key, new_data_key, open_bytes, seal_bytes
from petatrain.storage import StorageOptions, join
from petatrain.storage.checksum import checksum_bytes, verify
from petatrain.storage.fs import atomic_write, exists, read_bytes
from petatrain.train.run_dir import run_id

WEIGHTS = "model.safetensors"
RECORD = "COMMITTED"
FORMAT = 1


def final_dir(run_url: str) -> str:
    return join(run_url, "final")


def final_context(run_url: str, options: StorageOptions | None) -> str:
    """What the final weights' data key and chunks are bound to."""
    return f"run {run_id(run_url, options)}/final/{WEIGHTS}"


def write_final(run_url: str, data: bytes, step: int, options: StorageOptions | None = None) -> dict[str, Any]:
    """The weights (safetensors bytes; sealed when the run is encrypted), then their record
    (signed when a signing key is configured); returns the record."""
    folder = final_dir(run_url)
    record: dict[str, Any] = {"file": WEIGHTS, "step": step, "format": FORMAT}
    keys = encryption_keys(options)
    if keys is not None:
        context = final_context(run_url, options)
        key, record["encryption"] = new_data_key(keys, context)
        data = seal_bytes(data, key, context)
    atomic_write(join(folder, WEIGHTS), data, options)
    record.update(bytes=len(data), checksum=checksum_bytes(data))
    if signing.signs(options):
        record[signing.SHA256] = signing.sha256_hex(data)
        record["signature"] = signing.sign(options, signing.canonical(record))
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
        signed = signing.check(options, signing.canonical(record), record.get("signature"), f"{marker}")
        data = read_bytes(weights, options)
        if len(data) != record.get("bytes"):
            raise ValueError(f"{len(data)} bytes, {record.get('bytes')} recorded")
        verify(data, str(record.get("checksum")), weights)
        if signed and record.get(signing.SHA256) != signing.sha256_hex(data):
            raise ValueError("its SHA-256 does not match the signed record")
        if "encryption" in record:
            keys = encryption_keys(options)
            if keys is None:
                raise CorruptDataError(
                    f"{weights} is encrypted; set storage.encryption.key to the keyring it was written with"
                )
            context = final_context(run_url, options)
            data = open_bytes(data, data_key(keys, record["encryption"], context), context)
        return load(data), record
    except (OSError, ValueError) as exc:
        raise CorruptDataError(f"{weights} does not verify: {exc}") from None
