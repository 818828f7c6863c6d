"""One rank's checkpoint tensors: the snapshot the loop hands the writer, the host buffers it is
copied into, and the flat names (`model/FQN`, `optim/FQN/KEY`, `rng/NAME`) a rank file holds."""

from __future__ import annotations

import json
from collections.abc import Callable
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
    # Staged on the GPU: `pending.fill(tensors)` puts the host copies in, on the writer's thread.
    pending: DeviceStage | None = None


class DeviceStage:
    """A snapshot's copy made on the GPU (`tensors` holds it under the same names), and how to move
    it to the host (`fill`), on the writer's thread while the training goes on."""

    def __init__(
        self, names: list[str], host_buffer: Callable[[str, torch.Tensor], torch.Tensor], device: torch.device
    ):
        self.names, self.host_buffer = names, host_buffer
        self.ready = torch.cuda.Event() if device.type == "cuda" else None
        if self.ready is not None:
            self.ready.record(torch.cuda.current_stream(device))  # after the device copies, on the training's stream

    def fill(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the staged tensors in `tensors` by host copies (reused pinned buffers), copied on a
        stream of this thread's own once the device copies are done; returns when they have landed."""
        staged = [tensors[name] for name in self.names]
        hosts = [self.host_buffer(name, value) for name, value in zip(self.names, staged, strict=True)]
        if self.ready is None:  # a CPU's "device" (the tests')
            for host, value in zip(hosts, staged, strict=True):
                host.copy_(value)
        else:
            device = staged[0].device
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device=device)
                stream.wait_event(self.ready)
                with torch.cuda.stream(stream):
                    for host, value in zip(hosts, staged, strict=True):
                        host.copy_(value, non_blocking=True)
                stream.synchronize()
        tensors.update(zip(self.names, hosts, strict=True))


class HostBuffers:
    """Host-memory snapshot buffers, allocated once and reused by every checkpoint.

    Allocating fresh host memory per checkpoint made the snapshot pay for page faults on
    every byte (more than the copy itself); reused buffers pay only for the copy. On CUDA
    they are pinned, so the device-to-host copies run at full bandwidth. The next
    snapshot must not start before the writer has finished reading them (the loop waits).

    `device_staging` (a GPU's tensors): where the device has room for a second copy of them beside
    the training's peak memory so far (`room`), a snapshot is one device-to-device copy into buffers
    kept on the GPU (~8 ms for a 1.3B model's 16 GB of weights and Adam moments at an H200's
    bandwidth, against 0.32 s measured over PCIe into host memory), and the writer's thread moves it
    to the pinned host buffers, allocating them the first time, while training goes on
    (`DeviceStage.fill`). Else the copies go to the host and the loop waits for them.
    """

    HEADROOM = 0.92  # the device's share the training's reserved peak and the staging copy may fill together

    def __init__(self, *, device_staging: bool = False) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self.device_staging = device_staging
        self._queued: dict[str, torch.Tensor] = {}  # a snapshot's GPU tensors, until `settle`
        self.pending: DeviceStage | None = None  # the last snapshot's device copy, for the writer to fill from
        self.state_cache: Any = None  # what train.parallel.state_for_save keeps of the state dicts between snapshots

    def copy(self, name: str, value: Any) -> torch.Tensor:
        """`value` at this moment: a host copy, or (a GPU's tensor) `value` itself until `settle` copies it."""
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        if hasattr(value, "to_local"):  # a DTensor (FSDP): this rank's shard
            value = value.to_local()
        value = value.detach()
        if value.device.type == "cuda":
            self._queued[name] = value
            return value
        return self.host_buffer(name, value).copy_(value)

    def host_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The reused host buffer for `name`, pinned for a GPU's tensor."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buffer = self._buffers[name] = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
        return buffer

    def settle(self) -> dict[str, torch.Tensor]:
        """After a snapshot's `copy` calls, its GPU tensors' copies by name: made on the device (the
        writer then fills the host buffers from `pending`), or in the host buffers, landed."""
        queued, self._queued = self._queued, {}
        self.pending = None
        if not queued:
            return {}
        nbytes = sum(t.numel() * t.element_size() for t in queued.values())
        device = next(iter(queued.values())).device
        if self.device_staging and self.room(nbytes, device):
            copies = {name: self._device_buffer(name, value) for name, value in queued.items()}
            torch._foreach_copy_(list(copies.values()), list(queued.values()))
            self.pending = DeviceStage(list(copies), self.host_buffer, device)
            return copies
        self._device.clear()  # no longer room: the training's memory, not the staging's
        hosts = {name: self.host_buffer(name, value).copy_(value, non_blocking=True) for name, value in queued.items()}
        torch.cuda.synchronize()  # the non-blocking copies must land before the writer reads
        return hosts

    def room(self, nbytes: int, device: torch.device) -> bool:
        """Whether `device` holds a copy of `nbytes` beside the most this process has reserved there yet
        (the training's peak, once it has stepped), less the staging buffers it already keeps."""
        kept = sum(t.numel() * t.element_size() for t in self._device.values())
        free, total = torch.cuda.mem_get_info(device)
        others = max(0, total - free - torch.cuda.memory_reserved(device))  # other processes on the device
        return torch.cuda.max_memory_reserved(device) - kept + others + nbytes <= self.HEADROOM * total

    def _device_buffer(self, name: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._device.get(name)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._device[name] = torch.empty_like(source)
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
    twice, as tied weights are, is copied the second time: safetensors refuses shared memory).
    GPU tensors may be staged on the device: then `buffers.pending` holds the `DeviceStage` the
    writer fills the host buffers from (the snapshot's `pending`)."""
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
    tensors.update(buffers.settle())
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
