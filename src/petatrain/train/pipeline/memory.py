"""A pipeline rank's memory: what it holds for good (weights, gradients, optimizer state) and the
activations autograd keeps between a micro-batch's forward and its backward, measured and predicted.

Measured: `SavedActivations` counts the bytes of the tensors autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`; parameters left out, a storage saved twice counted
once) while they are alive, and keeps the high-water mark: the same on CPU and GPU, where a CPU
process has no allocator statistics to ask. On CUDA the allocator's own peak is reported beside it.

Predicted: the layer profile's per-unit saved bytes of one micro-batch, put in flight and taken out
in the order the schedule runs its actions (torch's `pipeline_order`: F adds a micro-batch's
activations of a part, B frees them; under ZBV the input-gradient step I keeps them for the weight
step W, which frees them), plus the state bytes of the parameters the rank holds. Exact for
GPipe, 1F1B and interleaved (tests/test_pipeline.py); under ZBV torch 2.13 also keeps each
micro-batch's loss graph (the logits) until the end of the step, which the prediction leaves out
(25-75% more on the last part's rank of the tiny GPT). Under `data: fsdp` the gathered weights a
block saves for its backward count as activations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def state_copies(optimizer: str, precision: str) -> float:
    """Bytes of state per byte of fp32 parameters: the weights, their gradients and the optimizer's
    (AdamW: 4, SGD with momentum: 3), as `plan` counts them (cost/workload.py)."""
    from petatrain.cost.workload import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

    return (WEIGHT_BYTES[precision] + GRAD_BYTES[precision] + OPTIMIZER_BYTES[optimizer]) / 4


class SavedActivations:
    """While entered: the live bytes autograd holds for backward, and their peak."""

    def __init__(self, params: list[torch.Tensor]):
        self.skip = {_storage(p) for p in params}
        self.live = 0
        self.peak = 0
        self.refs: dict[int, int] = {}  # storage pointer -> saved tensors holding it
        self._hooks: Any = None

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> Any:
        ptr = _storage(tensor)
        if ptr in self.skip or ptr == 0:
            return tensor
        return _Held(self, tensor, ptr, tensor.untyped_storage().nbytes())

    def _add(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        if self.refs[ptr] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _drop(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.live -= nbytes


class _Held:
    """A saved tensor, counted until autograd lets go of it (after its backward)."""

    __slots__ = ("nbytes", "owner", "ptr", "tensor")

    def __init__(self, owner: SavedActivations, tensor: torch.Tensor, ptr: int, nbytes: int):
        self.owner, self.tensor, self.ptr, self.nbytes = owner, tensor, ptr, nbytes
        owner._add(ptr, nbytes)

    def __del__(self) -> None:
        self.owner._drop(self.ptr, self.nbytes)


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes this rank holds of weights, gradients and optimizer state (its shards, under FSDP).
    Gradients count at their parameters' size: dropped between steps (zero_grad), they are there
    during every step's backward and update."""
    tensors: dict[int, torch.Tensor] = {}
    grads = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.untyped_storage().data_ptr() not in tensors:
            tensors[local.untyped_storage().data_ptr()] = local
            grads += local.untyped_storage().nbytes() if p.requires_grad else 0
    for state in optimizer.state.values() if optimizer is not None else ():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                local = t.to_local() if hasattr(t, "to_local") else t
                tensors[local.untyped_storage().data_ptr()] = local
    return grads + sum(t.untyped_storage().nbytes() for t in tensors.values())


def activation_peak(actions: list[Any], saved: dict[int, float]) -> float:
    """The most activation bytes held at once when a rank runs `actions` (torch's `pipeline_order`
    for it: F, B, I, W of a part and micro-batch), `saved[part]` a micro-batch's bytes of that part."""
    live = peak = 0.0
    for action in actions:
        if action is None:
            continue
        kind = getattr(action.computation_type, "value", action.computation_type)
        part = action.stage_index
        if kind == "F":
            live += saved.get(part, 0.0)
            peak = max(peak, live)
        elif kind in ("B", "W"):  # a full backward, or ZBV's weight step after its input step (I)
            live -= saved.get(part, 0.0)
    return peak
