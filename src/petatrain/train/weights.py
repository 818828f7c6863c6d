"""A run's model as it was trained, for whoever loads it (`serve`, the evaluation gate, `sample`):
its config, the dataset's tokenizer and the weights of the chosen checkpoint, each checked against
the record the run (or ingest) committed before it is used.

`--checkpoint final` is `RUN/final/model.safetensors` with its COMMITTED record; `latest` the newest
committed checkpoint whose files all verify; a step number that checkpoint. Checkpoint files are
read whatever strategy wrote them (DDP, FSDP rows, pipeline parts) into whole tensors by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from petatrain import config as config_mod
from petatrain.config import JobConfig
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage import StorageOptions, join
from petatrain.storage.checksum import verify
from petatrain.storage.fs import exists, read_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Served:
    """A model ready to serve and where it came from (`GET /v1/models`)."""

    run: str
    config: JobConfig
    weights: dict[str, torch.Tensor]
    tokenizer_json: str
    eos_id: int | None
    source: str  # "final" | "checkpoint"
    step: int
    checksum: str  # the final weights' checksum, or the checkpoint record's (state.json's)

    def describe(self) -> dict[str, Any]:
        return {"run": self.run, "source": self.source, "step": self.step, "checksum": self.checksum}


def load(run_url: str, checkpoint: str = "final", options: StorageOptions | None = None) -> Served:
    """The run's model at `checkpoint` (final | latest | STEP), verified; one-line errors otherwise."""
    from petatrain.models import build_model

    cfg = _run_config(run_url, options)
    tokenizer, eos = _tokenizer(cfg, options)
    spec = build_model(cfg.model, cfg.train)
    if checkpoint == "final":
        from petatrain.train.checkpoint import read_final

        tensors, record = read_final(run_url, options)
        source, step, checksum = "final", int(record["step"]), str(record["checksum"])
    else:
        tensors, step, checksum = _checkpoint_tensors(run_url, checkpoint, spec.module, options)
        source = "checkpoint"
    _check_names(tensors, spec.module, run_url, checkpoint)
    return Served(
        run=run_url, config=cfg, weights=tensors, tokenizer_json=tokenizer, eos_id=eos, source=source, step=step,
        checksum=checksum,
    )  # fmt: skip


def run_options(run_url: str, options: StorageOptions | None) -> StorageOptions:
    """`options` with the key references of the run's own config where `options` names none: an
    encrypted run is served with the keyring it was trained with, as its config.yaml records it."""
    import dataclasses

    options = options or StorageOptions()
    given, own = options.protection, _run_config(run_url, options).storage.options().protection
    protection = dataclasses.replace(
        given,
        encryption_key=given.encryption_key or own.encryption_key,
        signing_key=given.signing_key or own.signing_key,
        verify_signatures=given.verify_signatures or own.verify_signatures,
        unsigned_datasets=given.unsigned_datasets or own.unsigned_datasets,
    )
    return dataclasses.replace(options, protection=protection)


def _run_config(run_url: str, options: StorageOptions | None) -> JobConfig:
    url = join(run_url, "config.yaml")
    if not exists(url, options):
        raise PetatrainError(f"{run_url} is not a petatrain run (no config.yaml)")
    return config_mod.from_yaml(read_bytes(url, options).decode(), url)


def _tokenizer(cfg: JobConfig, options: StorageOptions | None) -> tuple[str, int | None]:
    """The dataset's tokenizer file, checked against the checksum its manifest committed."""
    from petatrain.data.index import read_manifest, split_version

    manifest = read_manifest(cfg.data.dataset, options)
    if manifest is None:
        raise PetatrainError(f"the run's dataset {cfg.data.dataset} is gone: its tokenizer is needed to serve")
    info = manifest.tokenizer
    if info is None:
        raise PetatrainError(f"the run's dataset {cfg.data.dataset} records no tokenizer; serve decodes text with it")
    url = join(split_version(cfg.data.dataset)[0], info.path)
    data = read_bytes(url, options)
    if info.checksum:
        try:
            verify(data, info.checksum, url)
        except ValueError as exc:
            raise CorruptDataError(f"{url} does not verify: {exc}") from None
    return data.decode(), info.eos_id


def _checkpoint_tensors(
    run_url: str, which: str, model: torch.nn.Module, options: StorageOptions | None
) -> tuple[dict[str, torch.Tensor], int, str]:
    """(model tensors by name, step, record checksum) of checkpoint `which` (latest | STEP)."""
    from petatrain.train import checkpoint as ckpt

    steps = ckpt.committed_steps(run_url, options)
    if which == "latest":
        for step in reversed(steps):
            try:
                return _read_checkpoint(run_url, step, model, options)
            except CorruptDataError as exc:
                log.warning("skipping checkpoint: %s", exc)
        raise PetatrainError(f"{run_url} has no committed checkpoint that verifies")
    if not which.isdigit():
        raise PetatrainError(f"--checkpoint {which!r}: final, latest or a step number")
    if int(which) not in steps:
        shown = ", ".join(map(str, steps[-5:])) or "none"
        raise PetatrainError(f"{run_url} has no committed checkpoint of step {int(which)} (committed: {shown})")
    return _read_checkpoint(run_url, int(which), model, options)


def _read_checkpoint(
    run_url: str, step: int, model: torch.nn.Module, options: StorageOptions | None
) -> tuple[dict[str, torch.Tensor], int, str]:
    import functools
    import json

    from petatrain.models import tied_names
    from petatrain.train import checkpoint as ckpt
    from petatrain.train.strategies.base import read_by_name

    state = ckpt.verify_checkpoint(run_url, step, options)
    read = functools.partial(ckpt.read_rank_tensors, run_url, state, options=options)  # checksummed as read
    merged = read_by_name(state, read, rank=0, world=0, ties=tied_names(model))[0]
    marker = json.loads(read_bytes(join(ckpt.step_dir(run_url, step), ckpt.COMMITTED), options))
    tensors = {name[len("model/") :]: t for name, t in merged.items() if name.startswith("model/")}
    return tensors, step, str(marker["state_checksum"])


def _check_names(tensors: dict[str, torch.Tensor], model: torch.nn.Module, run_url: str, which: str) -> None:
    from petatrain.models import tied_names
    from petatrain.train.strategies.base import alias_ties

    alias_ties(tensors, {}, tied_names(model))
    wanted = model.state_dict()
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise CorruptDataError(f"{run_url} ({which}): the weights hold no tensor for {', '.join(missing[:3])}")
    for name, value in wanted.items():
        if tensors[name].shape != value.shape:
            raise CorruptDataError(
                f"{run_url} ({which}): {name} has shape {tuple(tensors[name].shape)}, the run's model "
                f"{tuple(value.shape)}"
            )
