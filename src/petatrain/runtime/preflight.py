"""The checks a run passes before anything starts: what would fail only on the workers, or only
after Ray started, fails here, in one line."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from petatrain import constants
from petatrain.config import JobConfig
from petatrain.errors import ConfigError, PetatrainError
from petatrain.host import memory_left
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import is_local, resolve

log = logging.getLogger(__name__)

POD_IP = "pod-ip"  # observe.metrics_host: this pod's IP, resolved by the driver where it runs


def pod_ip() -> str:
    """POD_IP (Kubernetes' downward API), else the address this host's name resolves to."""
    import socket

    found = os.environ.get("POD_IP", "").strip()
    if found:
        return found
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise ConfigError(
            f"observe.metrics_host pod-ip: POD_IP is not set and this host's name does not resolve ({exc})"
        ) from None


def checked(cfg: JobConfig, options: StorageOptions | None) -> JobConfig:
    """The config as the workers get it; what would fail only after Ray started fails here."""
    from petatrain.data import index
    from petatrain.errors import CorruptDataError
    from petatrain.storage.fs import exists
    from petatrain.train import strategies

    strategies.of(cfg).check_config(cfg)
    fits_this_host(cfg)
    if cfg.observe.profile_at > cfg.train.steps:  # else the run ends without the trace it was asked for
        raise ConfigError(
            f"observe.profile_at {cfg.observe.profile_at} is past train.steps {cfg.train.steps}: no step would "
            "be traced (0 turns tracing off)"
        )
    if cfg.observe.metrics_host == POD_IP:
        cfg = dataclasses.replace(cfg, observe=dataclasses.replace(cfg.observe, metrics_host=pod_ip()))
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


def fits_this_host(cfg: JobConfig, available: int | None = None) -> None:
    """A local run (no resources.address) on the CPU: refused in one line when the model states its
    workers hold (weights, gradients, optimizer state: exact, as `plan` counts them) exceed this host's
    available memory; warned when plan's whole estimate (activations too) does. Without it, a model
    too large was OOM-killed on every attempt and reported as a worker fault. (On a cluster or a GPU
    the driver does not hold the memory the workers get.)"""
    from petatrain.cost.workload import Workload
    from petatrain.plan.estimate import memory_per_device
    from petatrain.train import strategies

    if cfg.resources.address or cfg.resources.accelerator == "gpu":
        return
    available = memory_left() if available is None else available
    if available is None:
        return
    workers = cfg.parallel.worker_range()[1]
    try:
        w = Workload.from_config(cfg)
        memory = memory_per_device(w, strategy=strategies.sized(cfg), count=workers, cpu=True)
    except (ConfigError, ValueError):  # a shape plan cannot estimate: the workers' own checks say why
        return
    gib = 2**30
    states = workers * (memory.weights + memory.gradients + memory.optimizer)
    if workers * memory.total <= available or _has_cuda():  # the states are part of the total
        return
    if states > available:
        raise ConfigError(
            f"the model's weights, gradients and optimizer state take {states / gib:.1f} GiB on {workers} "
            f"worker(s) (petatrain plan's count: {memory.weights / gib:.2f} + {memory.gradients / gib:.2f} + "
            f"{memory.optimizer / gib:.2f} GiB each); this host has {available / gib:.1f} GiB available"
        )
    log.warning(
        "plan estimates %.1f GiB for %d worker(s) at their peak (%s), more than the %.1f GiB this host has "
        "available: the run may be OOM-killed", workers * memory.total / gib, workers, memory.phase,
        available / gib,
    )  # fmt: skip


def _has_cuda() -> bool:
    """Whether torch sees a GPU here (accelerator auto), asked only when a model would not fit: torch's
    import takes ~1 s, which a config error or a missing dataset should not wait for."""
    import torch

    return torch.cuda.is_available()


def says_if_nothing_is_held_out(cfg: JobConfig, options: StorageOptions | None) -> None:
    """A dataset too small for the held-out split: said when the run starts (evaluation is skipped),
    not found later. (A run refused before it starts says only why it is refused.)"""
    from petatrain.data import index
    from petatrain.train.batches import held_out, training_samples

    try:
        rows = index.open_dataset(cfg.data.dataset, options).shards.column("rows").to_pylist()
    except PetatrainError:
        return  # the loader says what is wrong with it
    if not sum(rows):
        return  # an empty dataset: the loader refuses it
    if cfg.data.eval_split == "rows" and cfg.data.eval_fraction and training_samples(cfg, rows) == sum(rows):
        log.warning(
            "%s holds out no row at data.eval_fraction %g (its shards hold %d rows or fewer): the run is not "
            "evaluated; raise data.eval_fraction", cfg.data.dataset, cfg.data.eval_fraction, max(rows, default=0),
        )  # fmt: skip
    elif cfg.data.eval_split == "shards" and cfg.data.eval_shards and not held_out(cfg, len(rows)):
        log.warning(
            "%s has %d shard(s), not more than data.eval_shards %d: nothing is held out and the run is not "
            "evaluated", cfg.data.dataset, len(rows), cfg.data.eval_shards,
        )  # fmt: skip


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


def reads_its_dataset(
    cfg: JobConfig, run_url: str, options: StorageOptions | None, *, carry_step: int | None = None
) -> None:
    """A continuing run resumes its newest checkpoint's loader position: refuse (one line, before
    anything starts) a dataset that is not the one that position counts in. (A run started by
    `train --continue` that has no checkpoint of its own yet carries its first one's position over.)"""
    from petatrain.data import index
    from petatrain.train.batches import training_samples
    from petatrain.train.checkpoint import latest_verified

    state = latest_verified(run_url, options)
    loader = state.loader if state is not None else None
    if state is None or not isinstance(loader, dict) or state.step == carry_step:
        return
    try:
        dataset = index.open_dataset(cfg.data.dataset, options)
    except PetatrainError:
        return  # the loader says what is wrong with it, as it does for a new run
    version = loader.get("dataset_version")
    samples = training_samples(cfg, dataset.shards.column("rows").to_pylist())
    if version not in (None, dataset.manifest.generation) or loader.get("num_samples") not in (None, samples):
        trained = f"version {version}" if version is not None else f"{loader.get('num_samples')} samples"
        raise PetatrainError(
            f"--run-dir {run_url}: its checkpoint of step {state.step} is a position in {trained} of "
            f"{index.split_version(cfg.data.dataset)[0]}; data.dataset {cfg.data.dataset} gives version "
            f"{dataset.manifest.generation} ({samples} samples): a run resumes on the data it trained on "
            "(train --continue carries a run onto a later version)"
        )


def may_carry(branch: Any, cfg: JobConfig, options: StorageOptions | None) -> dict[str, Any]:
    """`train --continue RUN@STEP`: the source's checkpoint can be carried onto cfg's dataset, or one
    line says why not: another model shape or vocabulary, another dataset, an earlier version, a
    held-out split an append moves. (That it has steps left to train, api.train checks.)

    Returns what the carry-over pass holds, for the run's lineage: {"from_version", "to_version",
    "new_rows" (training rows the later versions added), "replay_rows" (rows of the earlier one
    mixed in)}; no new rows when it continues on the same version."""
    from petatrain.config import _flat
    from petatrain.data import index
    from petatrain.train import run_dir
    from petatrain.train.checkpoint.reader import read_state

    where = branch.label
    prior = run_dir.prior_run(branch.source, options)
    source = prior.config if prior is not None else {}
    if not source:
        raise ConfigError(f"--continue {where}: no run ledger there to take the model and data from")
    before, here = _flat(source.get("model") or {}), _flat(cfg.to_dict()["model"])
    for key, value in here.items():
        if key in before and before[key] != value:
            raise ConfigError(
                f"--continue {where}: model.{key} is {before[key]!r} there, {value!r} here; "
                "a continuation keeps the model's shape and vocabulary"
            )
    data = source.get("data") or {}
    split, fraction = data.get("eval_split", "shards"), data.get("eval_fraction")
    if split != "rows" or cfg.data.eval_split != "rows" or fraction != cfg.data.eval_fraction:
        raise ConfigError(
            f"--continue {where}: it held out data.eval_split {split}"
            f"{'' if split != 'rows' else f' {fraction}'}, this run {cfg.data.eval_split}"
            f"{'' if cfg.data.eval_split != 'rows' else f' {cfg.data.eval_fraction}'}; a run is carried onto new "
            "data only with the rows split at the same fraction (the shards split moves with each append); "
            "--from continues it on the same data"
        )
    state = read_state(branch.source, branch.step, options)
    root, _ = index.split_version(cfg.data.dataset)
    old_root = index.split_version(str(data.get("dataset") or ""))[0]
    same = old_root == root or (is_local(old_root) and is_local(root) and os.path.abspath(old_root) == root)
    if not same:
        raise ConfigError(
            f"--continue {where}: it trained on {old_root}, data.dataset is {root}; "
            "a continuation goes on with later versions of the same dataset"
        )
    old_version = state.loader.get("dataset_version") if isinstance(state.loader, dict) else None
    version = index.read_manifest(cfg.data.dataset, options)
    if not isinstance(old_version, int) or version is None or version.generation < old_version:
        shown = version.generation if version is not None else "none"
        raise ConfigError(
            f"--continue {where}: its checkpoint is a position in version {old_version} of {root}; "
            f"data.dataset gives version {shown}: a continuation goes on with that version or a later one"
        )
    old = index.read_manifest(index.versioned(root, old_version), options)
    if old is not None and old.tokenizer != version.tokenizer:
        raise ConfigError(
            f"--continue {where}: version {old_version} and version {version.generation} of {root} "
            "were tokenized differently"
        )
    from petatrain.data.loading.continuation import replayed
    from petatrain.train.batches import training_samples

    rows = index.open_dataset(cfg.data.dataset, options).shards.column("rows").to_pylist()
    old_shards = old.totals.shards if old is not None else len(rows)
    old_rows = training_samples(cfg, rows[:old_shards])
    new_rows = training_samples(cfg, rows) - old_rows if version.generation > old_version else 0
    return {
        "from_version": old_version, "to_version": version.generation, "new_rows": new_rows,
        "replay_rows": replayed(new_rows, old_rows, cfg.data.replay),
    }  # fmt: skip


def has_final(run_url: str, options: StorageOptions | None) -> bool:
    """The run's final weights are committed (a run whose ledger ended but whose final/ is gone is not done)."""
    from petatrain.storage.fs import exists
    from petatrain.train.checkpoint.final import RECORD, final_dir

    return exists(join(final_dir(run_url), RECORD), options)
