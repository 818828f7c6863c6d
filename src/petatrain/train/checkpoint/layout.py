"""The names in a run's checkpoints folder: what strategies, the writer and the reader share."""

from __future__ import annotations

from petatrain.storage import join

FORMAT_VERSION = 1
COMMITTED = "COMMITTED"  # written last: the checkpoint exists once it is there
STATE = "state.json"


def step_dir(run_url: str, step: int) -> str:
    return join(run_url, "checkpoints", f"step-{step:08d}")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"
