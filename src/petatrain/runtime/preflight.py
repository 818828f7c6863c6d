"""The checks a run passes before anything starts: what would fail only on the workers, or only
after Ray started, fails here, in one line."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from petatrain import constants
from petatrain.config import JobConfig
from petatrain.errors import ConfigError, PetatrainError
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import is_local, resolve


def checked(cfg: JobConfig, options: StorageOptions | None) -> JobConfig:
    """The config as the workers get it; what would fail only after Ray started fails here."""
    from petatrain.data import index
    from petatrain.errors import CorruptDataError
    from petatrain.storage.fs import exists
    from petatrain.train import strategies

    strategies.get(cfg.parallel.strategy).check_config(cfg)
    if is_local(cfg.data.dataset):  # Ray workers do not share the driver's working directory
        dataset = os.path.abspath(resolve(cfg.data.dataset)[1])
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=dataset))
    if not exists(join(index.split_version(cfg.data.dataset)[0], index.MANIFEST), options):
        raise PetatrainError(
            f"no dataset at {cfg.data.dataset} (data.dataset); `petatrain demo` builds the demo dataset, "
            "`petatrain ingest SOURCES --out URL --tokenizer bytes --pack-length N` builds yours"
        )
    try:
        manifest = index.read_manifest(cfg.data.dataset, options)
    except CorruptDataError:  # a damaged manifest is the loader's to report, on the worker, as always
        manifest = None
    keys = index.dataset_keys(cfg.data.dataset, manifest, options) if manifest else None
    if keys is not None:
        keys.check()  # a missing or wrong keyring: one line here, not a fault on every worker
    if manifest is not None:
        from petatrain.train.batches import check_dataset

        check_dataset(cfg, cfg.data.dataset, manifest)  # not three faults on the workers, 20 s later
    constants.controller_mode()  # a bad PETATRAIN_CONTROLLER fails here, before anything starts
    return cfg


def pinned(cfg: JobConfig, prior: Any, options: StorageOptions | None) -> JobConfig:
    """The config with data.dataset pinned to one version of the dataset (`DATASET@vN`), so that
    an append while the run trains never changes what its recoveries read: a new run takes the
    latest version; a continuing run the version it trained on, as its ledger records it (a run
    recorded before runs were pinned goes on unpinned)."""
    from petatrain.data import index

    root, version = index.split_version(cfg.data.dataset)
    if version is not None:
        return cfg
    recorded = (prior.config.get("data") or {}).get("dataset") if prior is not None else None
    if isinstance(recorded, str) and index.split_version(recorded)[0] == root:
        chosen = recorded
    else:
        manifest = index.read_manifest(root, options)
        if manifest is None:
            return cfg  # `checked` said so already, unless the dataset went away since
        chosen = index.versioned(root, manifest.generation)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=chosen))


def may_continue(prior: Any, cfg: JobConfig, run_url: str, resume: bool, may_change: tuple[str, ...]) -> None:
    """A run directory holding a run is continued only when asked to, and only with the same run's
    config (but for `may_change`: the hyperparameters a search's exploit mutates)."""
    from petatrain.config import RESUMABLE, resume_differences

    if not resume:
        raise ConfigError(
            f"--run-dir {run_url} holds {prior.describe()}: pass --resume to continue it, or give a new --run-dir"
        )
    changed = resume_differences(prior.config, cfg, may_change)
    if changed:
        raise ConfigError(
            f"--run-dir {run_url} holds a run with another config ({'; '.join(changed)}); "
            f"on --resume only {', '.join(RESUMABLE)} may change"
        )


def reads_its_dataset(cfg: JobConfig, run_url: str, options: StorageOptions | None) -> None:
    """A continuing run resumes its newest checkpoint's loader position: refuse (one line, before
    anything starts) a dataset that is not the one that position counts in."""
    from petatrain.data import index
    from petatrain.train.batches import held_out
    from petatrain.train.checkpoint import latest_verified

    state = latest_verified(run_url, options)
    loader = state.loader if state is not None else None
    if state is None or not isinstance(loader, dict):
        return
    try:
        dataset = index.open_dataset(cfg.data.dataset, options)
    except PetatrainError:
        return  # the loader says what is wrong with it, as it does for a new run
    version = loader.get("dataset_version")
    rows = dataset.shards.column("rows").to_pylist()
    samples = sum(rows[: len(rows) - held_out(cfg, len(rows))])
    if version not in (None, dataset.manifest.generation) or loader.get("num_samples") not in (None, samples):
        trained = f"version {version}" if version is not None else f"{loader.get('num_samples')} samples"
        raise PetatrainError(
            f"--run-dir {run_url}: its checkpoint of step {state.step} is a position in {trained} of "
            f"{index.split_version(cfg.data.dataset)[0]}; data.dataset {cfg.data.dataset} gives version "
            f"{dataset.manifest.generation} ({samples} samples): a run resumes on the data it trained on"
        )


def has_final(run_url: str, options: StorageOptions | None) -> bool:
    """The run's final weights are committed (a run whose ledger ended but whose final/ is gone is not done)."""
    from petatrain.storage.fs import exists
    from petatrain.train.checkpoint.final import RECORD, final_dir

    return exists(join(final_dir(run_url), RECORD), options)
