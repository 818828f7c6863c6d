"""One rank's checkpoint tensors: the snapshot the loop hands the writer, the host buffers it is
copied into, and the flat names (`model/FQN`, `optim/FQN/KEY`, `rng/NAME`) a rank file holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class Snapshot:
    """Host-memory copy of one rank's state at a step boundary."""

    step: int
    rank: int
    world_size: int
    tensors: dict[str, torch.Tensor]  # flat names -> CPU tensors (may be empty on DDP ranks > 0)
    meta: dict[str, Any] = field(default_factory=dict)  # JSON: loader state, optimizer groups, ...
    # The training-state tensors `tensors` references instead of copying, and their version
    # counters when taken: the loop must not change them before `CheckpointWriter.wait_for_staging()`.
    live: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class HostBuffers:
    """Host-memory snapshot buffers, allocated once and reused by every checkpoint.

    Allocating fresh host memory per checkpoint made the snapshot pay for page faults on
    every byte (more than the copy itself); reused buffers pay only for the copy. On CUDA
    they are pinned, so the device-to-host copies run at full bandwidth. The next
    snapshot must not start before the writer has finished reading them (the loop waits).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        if hasattr(value, "to_local"):  # a DTensor (FSDP): this rank's shard
            value = value.to_local()
        value = value.detach()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            pin = value.device.type == "cuda"
            buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
            self._buffers[name] = buffer
        buffer.copy_(value, non_blocking=value.device.type == "cuda")
        return buffer


def flatten_state(
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    *,
    with_model: bool,
    buffers: HostBuffers | None = None,
    live_ptrs: frozenset[int] = frozenset(),
) -> tuple[dict, dict, list[torch.Tensor]]:
    """(tensors, json, live) of a model + optimizer state dict keyed by parameter name (FQN).

    Tensors are copied to host buffers, except contiguous CPU tensors whose memory starts at
    one of `live_ptrs`: those are referenced as they are, and the state-dict values they
    came from are listed in `live`, to watch their version counters (a storage referenced
    twice, as tied weights are, is copied the second time: safetensors refuses shared memory)."""
    buffers = buffers or HostBuffers()
    tensors: dict[str, torch.Tensor] = {}
    live: list[torch.Tensor] = []
    storages: set[int] = set()

    def take(name: str, value: Any) -> torch.Tensor:
        local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(local, torch.Tensor) and local.data_ptr() in live_ptrs and local.device.type == "cpu":
            storage = local.untyped_storage().data_ptr()
            if local.is_contiguous() and storage not in storages:
                storages.add(storage)
                live.append(value)  # not `local`: a DTensor's in-place updates bump its own version only
                return local.detach()
        return buffers.copy(name, value)

    if with_model:
        for name, value in model_sd.items():
            tensors[f"model/{name}"] = take(f"model/{name}", value)
        for fqn, state in optim_sd["state"].items():
            for key, value in state.items():
                tensors[f"optim/{fqn}/{key}"] = take(f"optim/{fqn}/{key}", value)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies must land before the writer reads
    groups = [{k: v for k, v in g.items()} for g in optim_sd["param_groups"]]
    return tensors, {"param_groups": groups}, live


def split_name(name: str) -> tuple[str, str, str]:
    """A flattened tensor name's parts: ("model", FQN, ""), ("optim", FQN, KEY) or ("rng", NAME, "")."""
    kind, _, rest = name.partition("/")
    if kind == "optim":
        fqn, _, key = rest.rpartition("/")
        return kind, fqn, key
    return kind, rest, ""


def unflatten_state(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        kind, fqn, key = split_name(name)
        if kind == "model":
            model[fqn] = value
        elif kind == "optim":
            optim.setdefault(fqn, {})[key] = value
    return model, optim


# safetensors' dtype codes (https://github.com/huggingface/safetensors: the format's spec).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


def write_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], sink: Any) -> None:
    """Write `tensors` as a safetensors file to `sink` (anything with `write`), streaming each
    tensor's bytes from its memory: an encrypting sink then never holds the file in memory,
    and no plaintext copy reaches a disk. The library's `load` reads what this writes."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    names = sorted(tensors)
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec pads the header to 8 bytes with spaces
    sink.write(len(raw).to_bytes(8, "little"))
    sink.write(raw)
    for name in names:
        tensor = tensors[name].detach()
        if tensor.numel():
            sink.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
