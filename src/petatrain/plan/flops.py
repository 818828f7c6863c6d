"""A FLOP counter that sees every kernel torch dispatches, SDPA on CPU included, and knows causal masks.

torch's `FlopCounterMode` counts matmuls through a formula registry, but the CPU flash
kernel (`_scaled_dot_product_flash_attention_for_cpu`) is not registered, so SDPA on the
CPU counts zero; and its SDPA formulas ignore `is_causal`. This counter is a
`TorchDispatchMode` that uses torch's registry for everything it knows (mm, addmm, bmm,
convolutions, ...) and its own formula for every SDPA kernel: QKᵀ and PV over the
(query, key) pairs the kernel computes — s_q·s_k without a causal mask, the lower
triangle with one — and twice that for the backward (torch's convention: dQ, dK, dV and
dP, without flash's recomputation of the scores).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Forward SDPA kernels and their backwards, on every device torch 2.13 has.
_SDPA_FORWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}
_SDPA_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
}


def causal_pairs(s_q: int, s_k: int) -> int:
    """(query, key) pairs a causal kernel computes: query i sees keys 0..i (top-left aligned, as torch's is_causal)."""
    if s_k >= s_q:
        return s_q * (s_q + 1) // 2
    return s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k


def attention_forward_flops(batch_heads: int, s_q: int, s_k: int, d_qk: int, d_v: int, causal: bool) -> int:
    """QKᵀ (2·d_qk per pair) and PV (2·d_v per pair) over the computed pairs."""
    pairs = causal_pairs(s_q, s_k) if causal else s_q * s_k
    return batch_heads * pairs * 2 * (d_qk + d_v)


def _bound_arguments(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _sdpa_flops(func, args, kwargs, backward: bool) -> int:
    bound = _bound_arguments(func, args, kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    *lead, s_q, d_qk = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    batch_heads = 1
    for dim in lead:
        batch_heads *= dim
    causal = bool(bound.get("is_causal", False))
    forward = attention_forward_flops(batch_heads, s_q, s_k, d_qk, d_v, causal)
    return 2 * forward if backward else forward


class FlopCounter(TorchDispatchMode):
    """Count FLOPs of everything run inside `with FlopCounter() as fc:`; `fc.total`, `fc.by_op`."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _SDPA_FORWARD:
            flops = _sdpa_flops(func, args, kwargs, backward=False)
        elif packet in _SDPA_BACKWARD:
            flops = _sdpa_flops(func, args, kwargs, backward=True)
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return out
        self.total += int(flops)
        self.by_op[str(packet).removeprefix("aten.")] += int(flops)
        return out


def count_training_step(model: torch.nn.Module, loss_fn, tokens: torch.Tensor) -> FlopCounter:
    """FLOPs of one forward + backward of `loss_fn(model, tokens)` (no optimizer step)."""
    with FlopCounter() as counter:
        loss_fn(model, tokens).backward()
    return counter
