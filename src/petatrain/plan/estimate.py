"""Analytic estimates applied to petatrain's GPT/MLP as they are implemented (models/gpt.py):
parameters, FLOPs, memory per device.

The published formulas are in `plan.formulas` (re-exported here); this module applies them
with the element widths, dropout masks, attention kernel and recompute policy of the real
code, so that `petatrain profile` can hold the estimate to a measurement. How a strategy
partitions the model states is the strategy's (`train.strategies`).

Units: bytes, FLOPs, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from petatrain.cost.formulas import (  # noqa: F401  (re-exported: the formulas plan cites)
    bubble_fraction,
    bubble_overhead,
    expected_goodput,
    korthikanti_activation_bytes_per_layer,
    kv_cache_bytes,
    layer_activation_bytes,
    megatron_flops_per_iteration,
    megatron_model_flops_per_iteration,
    megatron_params,
    megatron_training_seconds,
    mfu,
    palm_flops_per_token,
    ring_allreduce_seconds,
    ring_collective_seconds,
    zero_model_state_bytes,
)
from petatrain.cost.workload import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, Workload  # noqa: F401
from petatrain.train import recipe, strategies
from petatrain.train.recipe import young_daly_interval  # noqa: F401


@dataclass(kw_only=True, slots=True)
class MemoryEstimate:
    """Peak bytes per device, split by what holds them at the peak."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    phase: str  # the moment of the step where the peak is

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    def to_dict(self) -> dict[str, int]:
        return {
            "weights": int(self.weights),
            "gradients": int(self.gradients),
            "optimizer": int(self.optimizer),
            "activations": int(self.activations),
            "other": int(self.other),
            "total": int(self.total),
        }


def memory_per_device(
    w: Workload,
    *,
    strategy: str | strategies.Strategy,
    count: int,
    framework_overhead: float = 0.0,
    accumulation: int | None = None,
    cpu: bool = False,
) -> MemoryEstimate:
    """Peak memory of one device: the largest of the moments a training step goes through.

    Model states and the buffers beside them are laid out by the strategy
    (`Strategy.state_layout`, ZeRO's partitioning with torch's byte widths); activations follow
    layer_activation_bytes. The moments: the start of backward at the loss (all activations,
    the logits' gradients), a block's backward, a block's recomputation under full recompute,
    and the optimizer step. Gradients count at the forward/backward moments only when they
    outlive a micro-batch (accumulation, or a data-parallel wrapper's persistent buckets);
    otherwise they grow as activations free. `cpu` selects torch's CPU kernels (no fused
    dropout, single-tensor AdamW). `accumulation` defaults to the recipe's for `count` devices.
    """
    plan = strategies.get(strategy) if isinstance(strategy, str) else strategy
    if accumulation is None:
        accumulation = recipe.micro_batching(w, plan.data_parallel(count))[1]
    layout = plan.state_layout(w, count, accumulation)
    weights, grads, opt = layout.weights, layout.gradients, layout.optimizer
    stage_layers, buffers = layout.stage_layers, layout.buffers
    b, e = w.micro_batch, w.activation_bytes_per_element
    s, h, V = w.seq_len, w.d_model, w.vocab_size

    sbh = s * b * h
    t = layout.activation_shards  # tensor + sequence parallelism: each rank holds 1/t of every activation
    layer = w.layer_activations(b, cpu=cpu) / t
    masks = (e * sbh if cpu else sbh) if w.dropout > 0 else 0  # the embedding's dropout mask
    acts = layout.in_flight * stage_layers * layer + masks / t
    tail = (2 * 4 * sbh + 8 * s * b) / t  # final LayerNorm input and output (fp32), token ids
    head = 12 * s * b * V / t  # fp32 log-softmax output, its gradient and the logits' gradient (vocabulary-split)
    block_bwd = (1 + 2 * w.d_ff / h) * e * sbh / t  # incoming gradient + two MLP-wide gradients in a block's backward
    persistent = weights + opt
    grads_live = grads if (accumulation > 1 or count > 1) else 0.0
    layer_grads = w.grad_width * w.layer_params / layout.grad_shards

    moments = [
        # (name, gradients, activations, temporaries)
        ("backward at the loss", grads_live, acts + tail, head),
        ("backward of the last block", grads_live, acts, block_bwd),
    ]
    if w.recompute == "full":
        # One block rebuilt during backward, plus its incoming gradient, its output and the
        # two residual-branch outputs the recomputation makes on the way (measured: 4 × e·sbh).
        block = w.layer_activations(b, cpu=cpu, recompute="none") / t
        first = max(grads_live, grads - layer_grads) if stage_layers > 1 else grads_live
        moments = [
            ("backward at the loss", grads_live, acts + tail, head),
            ("recompute of the last block", grads_live, acts, block + 4 * e * sbh / t),
            ("recompute of the first block", first, acts / stage_layers, block + 4 * e * sbh / t),
        ]
    # Optimizer step: the recipe's AdamW runs tensor by tensor (foreach=False), two fp32
    # temporaries the size of the largest tensor (of this device's shard).
    opt_temp = 2 * 4 * w.largest_param / layout.optimizer_shards if w.optimizer == "adamw" else 0.0
    best = MemoryEstimate(
        weights=weights, gradients=grads, optimizer=opt, activations=0.0, other=opt_temp, phase="optimizer step"
    )
    for name, g, a, temp in moments:
        candidate = MemoryEstimate(
            weights=weights, gradients=g, optimizer=opt, activations=a, other=buffers + temp, phase=name
        )
        if candidate.total > best.total:
            best = candidate
    assert persistent <= best.total
    best.other += framework_overhead
    return best
