"""Branching a run from another run's checkpoint: `train --from RUN[@STEP]`, and PBT's exploit
(petatrain.tune), which continues a trial from a better trial's state.

The source checkpoint is verified, then copied into the run's own `checkpoints/` as its only
committed checkpoint (rank files and state.json first, COMMITTED last), so the attempt that
follows resumes from it as from any checkpoint of its own: weights, optimizer state, the
loader's position and the RNG. Checkpoints the run held before are removed first: they belong
to the line of training the branch abandons, and a later fault must not fall back to them.
"""

from __future__ import annotations

import os
import shutil

from petatrain.errors import ConfigError, CorruptDataError
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, copy, is_local, read_bytes, refuse_links, resolve
from petatrain.train.checkpoint.layout import COMMITTED, STATE, step_dir
from petatrain.train.checkpoint.reader import committed_steps, read_state, remove_checkpoint, verify_checkpoint
from petatrain.train.checkpoint.state import CheckpointState


def source_step(source: str, step: int | None, options: StorageOptions | None = None, *, flag: str = "--from") -> int:
    """`step`, or the newest committed checkpoint of `source`; ConfigError when it has none."""
    steps = committed_steps(source, options)
    if step is None:
        if not steps:
            raise ConfigError(f"{flag} {source}: it holds no committed checkpoint")
        return steps[-1]
    if step not in steps:
        held = ", ".join(str(s) for s in steps[-5:]) or "none"
        raise ConfigError(f"{flag} {source}@{step}: no committed checkpoint of step {step} (newest: {held})")
    return step


def adopt(source: str, step: int, run_url: str, options: StorageOptions | None = None) -> CheckpointState:
    """Make checkpoint `step` of `source` (a run, or a folder laid out as one) the newest committed
    checkpoint of `run_url`, with every checkpoint `run_url` held before removed; its record.

    CorruptDataError when the source does not verify; ConfigError for an encrypted one (its files
    are bound to the run that wrote them, so another run cannot read them)."""
    try:
        state = verify_checkpoint(source, step, options)
    except CorruptDataError as exc:
        raise CorruptDataError(f"--from {source}@{step}: {exc}") from None
    if state.keys:
        raise ConfigError(
            f"--from {source}@{step}: the checkpoint is encrypted and bound to the run that wrote it; "
            "a branch cannot read it (train --resume continues that run itself)"
        )
    for own in committed_steps(run_url, options):
        remove_checkpoint(run_url, own, options)
    _copy(source, state, run_url, options)
    return verify_checkpoint(run_url, step, options)


def copy_checkpoint(run_url: str, step: int, dest: str, options: StorageOptions | None = None) -> None:
    """Copy checkpoint `step` of `run_url` into `dest` laid out as a run (`dest/checkpoints/step-S/`):
    what a search hands Tune, so that another trial can branch from it."""
    _copy(run_url, read_state(run_url, step, options), dest, options)


def _copy(source: str, state: CheckpointState, dest: str, options: StorageOptions | None) -> None:
    """The checkpoint's files, then COMMITTED: the copy is a checkpoint once complete, never before."""
    src, dst = step_dir(source, state.step), step_dir(dest, state.step)
    for name in [*state.files, STATE]:
        _transfer(join(src, name), join(dst, name), options)
    atomic_write(join(dst, COMMITTED), read_bytes(join(src, COMMITTED), options), options)


def _transfer(src: str, dst: str, options: StorageOptions | None) -> None:
    """Copy one file: server-side within one store, streamed through this process between two."""
    src_fs, src_path = resolve(src, options)
    dst_fs, dst_path = resolve(dst, options)
    if type(src_fs) is type(dst_fs):
        copy(src, dst, options)
        return
    if is_local(dst):
        refuse_links(dst_path)
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
    with src_fs.open(src_path, "rb") as reader, dst_fs.open(dst_path, "wb") as writer:
        shutil.copyfileobj(reader, writer, 16 << 20)
