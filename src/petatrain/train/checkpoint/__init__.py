"""Asynchronous, verified, pickle-free checkpoints (docs/fault-tolerance.md, "Checkpoints").

The training loop pays only for a snapshot (`tensors.Snapshot`, host copies or live
references); `writer.CheckpointWriter` serialises, uploads and commits on a background thread
(every rank its file, rank 0 `state.json` and COMMITTED last). `reader` finds the newest
checkpoint that verifies and streams a rank file into tensors, checksummed on the way.
`state.CheckpointState` is the record, and `state.check_state` what resume relies on in it.
"""

from petatrain.train.checkpoint.final import read_final, write_final
from petatrain.train.checkpoint.reader import (
    committed_steps,
    latest_verified,
    read_rank_tensors,
    read_state,
    remove_checkpoint,
    verify_checkpoint,
)
from petatrain.train.checkpoint.state import (
    COMMITTED,
    FORMAT_VERSION,
    STATE,
    CheckpointState,
    check_state,
    rank_file,
    step_dir,
)
from petatrain.train.checkpoint.tensors import (
    DeviceStage,
    HostBuffers,
    Snapshot,
    flatten_state,
    split_name,
    unflatten_state,
)
from petatrain.train.checkpoint.writer import CheckpointWriter, StorageFaults, finish_writes

__all__ = [
    "COMMITTED",
    "FORMAT_VERSION",
    "STATE",
    "CheckpointState",
    "CheckpointWriter",
    "DeviceStage",
    "HostBuffers",
    "Snapshot",
    "StorageFaults",
    "check_state",
    "committed_steps",
    "finish_writes",
    "flatten_state",
    "latest_verified",
    "rank_file",
    "read_final",
    "read_rank_tensors",
    "read_state",
    "remove_checkpoint",
    "split_name",
    "step_dir",
    "unflatten_state",
    "verify_checkpoint",
    "write_final",
]
