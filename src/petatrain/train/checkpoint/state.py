"""A checkpoint's record, `state.json`: what it holds, and the checks resume relies on.

RUN/checkpoints/step-00001200/
    rank-00000.safetensors   this rank's tensors (which ranks write model and optimizer
                             state is the strategy's: `Strategy.saves_model`)
    state.json               `CheckpointState`
    COMMITTED                written last; holds the checksum of state.json
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from petatrain.train import strategies
from petatrain.train.checkpoint.layout import COMMITTED, FORMAT_VERSION, STATE, rank_file, step_dir  # noqa: F401


@dataclass(kw_only=True, slots=True)
class CheckpointState:
    """state.json: written by rank 0 once every rank's file is in, read by every rank at resume."""

    step: int
    world_size: int
    strategy: str  # parallel.strategy the files were written by
    files: dict[str, dict[str, Any]]  # rank file -> {"bytes": size, "checksum": "xxh3-128:..."}
    loader: dict[str, Any]  # the training loader's state_dict (StreamingDataset)
    param_groups: list[dict[str, Any]]  # the optimizer's hyper-parameters, parameters by name
    time: float  # when rank 0 wrote it (unix seconds)
    config_digest: str | None = None  # checksum of the resolved config that wrote it
    format: int = FORMAT_VERSION
    # Not in state.json: the files' wrapped data keys, which COMMITTED holds (so that rotating the
    # master key rewrites that one small record); {} when the checkpoint is not encrypted.
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "keys"}
        if self.config_digest is None:
            del out["config_digest"]
        return out

    @classmethod
    def from_json(cls, record: Any, step: int) -> CheckpointState:
        """The record of the checkpoint of step `step`, checked (`check_state`); ValueError naming
        the first field that is wrong."""
        check_state(record, step)
        names = {f.name for f in fields(cls)} - {"keys"}
        return cls(**{k: v for k, v in record.items() if k in names})


_CHECKSUM = re.compile(r"xxh3-128:[0-9a-f]{32}")
_RANK_FILE = re.compile(r"rank-(\d{5,})\.safetensors")
# The loader's resume state (`StreamingDataset.state_dict`): counts, where the record has them.
_LOADER_COUNTS = ("version", "epoch", "position", "num_samples", "shuffle_window", "dataset_version")
_LOADER_SIZES = ("world_size", "batch_size")


def _count(value: Any) -> bool:
    """A non-negative JSON integer (JSON's `true` is not one, though Python's True == 1)."""
    return type(value) is int and value >= 0


def check_state(state: Any, step: int) -> None:
    """ValueError naming the first field of `state` (a parsed state.json) that resume cannot rely
    on for the checkpoint of step `step`.

    COMMITTED's checksum only says state.json is the one committed, not that its writer was
    petatrain: a record edited by hand or by a bug (checksum recomputed) must not steer resume
    (a negative step restarted the run from 0; a rank file left out loaded nothing)."""
    if not isinstance(state, dict):
        raise ValueError(f"{STATE} holds a JSON {type(state).__name__}, not an object")
    if type(state.get("format")) is not int or state["format"] != FORMAT_VERSION:
        raise ValueError(f"format {state.get('format')!r}; this petatrain reads format {FORMAT_VERSION}")
    if not _count(state.get("step")) or state["step"] != step:
        raise ValueError(f"step {state.get('step')!r} recorded in the folder of step {step}")
    world = state.get("world_size")
    if type(world) is not int or world < 1:
        raise ValueError(f"world_size {world!r} is not a positive integer")
    strategy = state.get("strategy")
    if not isinstance(strategy, str) or strategy not in strategies.TRAINABLE:
        raise ValueError(f"strategy {str(strategy)[:80]!r} is not one train runs ({', '.join(strategies.TRAINABLE)})")
    _check_files(state.get("files"), world, every_rank_writes=strategies.get(strategy).every_rank_writes)
    if "config_digest" in state and not isinstance(state["config_digest"], str):
        raise ValueError(f"config_digest {state['config_digest']!r} is not a string")
    if type(state.get("time")) not in (int, float):
        raise ValueError(f"time {str(state.get('time'))[:80]!r} is not a number")
    _check_loader(state.get("loader"))
    _check_param_groups(state.get("param_groups"))


def _check_files(files: Any, world: int, *, every_rank_writes: bool) -> None:
    """Rank files only, of ranks in the world, each with its size and xxh3 checksum; rank 0's
    always (it holds the model under DDP), every rank's where each holds its own shards."""
    if not isinstance(files, dict):
        raise ValueError(f"files {str(files)[:80]} is not an object")
    for name, info in files.items():
        match = _RANK_FILE.fullmatch(name)
        if match is None or int(match[1]) >= world:
            raise ValueError(f"files names {name[:80]!r}, not a rank file of world size {world}")
        if not isinstance(info, dict):
            raise ValueError(f"{name}: record {str(info)[:80]} is not an object")
        if not _count(info.get("bytes")):
            raise ValueError(f"{name}: size {info.get('bytes')!r} is not a byte count")
        if not isinstance(info.get("checksum"), str) or not _CHECKSUM.fullmatch(info["checksum"]):
            raise ValueError(f"{name}: checksum {info.get('checksum')!r} is not an xxh3-128 checksum")
    if rank_file(0) not in files:
        raise ValueError(f"files leaves out {rank_file(0)}")
    if every_rank_writes and len(files) != world:  # the names are distinct ranks below `world`
        raise ValueError(f"files names {len(files)} rank files; every one of the {world} ranks writes one")


def _check_loader(loader: Any) -> None:
    if not isinstance(loader, dict):
        raise ValueError(f"loader state {str(loader)[:80]} is not an object")
    for key in _LOADER_COUNTS + _LOADER_SIZES:
        if key in loader and (not _count(loader[key]) or (key in _LOADER_SIZES and loader[key] < 1)):
            raise ValueError(f"loader state {key} {loader[key]!r} is not a count")
    if "seed" in loader and type(loader["seed"]) is not int:
        raise ValueError(f"loader state seed {loader['seed']!r} is not an integer")
    if "shuffle" in loader and not isinstance(loader["shuffle"], bool):
        raise ValueError(f"loader state shuffle {loader['shuffle']!r} is not true or false")
    if "num_samples" in loader and loader.get("position", 0) > loader["num_samples"]:
        raise ValueError(f"loader state position {loader['position']} is beyond its {loader['num_samples']} samples")


def _check_param_groups(groups: Any) -> None:
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"param_groups {str(groups)[:80]} is not a list of objects")
    for group in groups:
        params = group.get("params", [])
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise ValueError(f"param_groups params {str(params)[:80]} is not a list of parameter names")
        lr = group.get("lr", 0.0)
        if type(lr) not in (int, float) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"param_groups lr {lr!r} is not a learning rate")
