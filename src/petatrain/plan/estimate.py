"""Analytic estimates: parameters, FLOPs, memory, step time, checkpoints, goodput.

The first half is the published formulas, each a small pure function citing its paper and
unit-tested against the paper's own numbers (tests/test_plan.py). The second half applies
them to petatrain's GPT/MLP as they are implemented (models/gpt.py): the same accounting,
with the element widths, dropout masks, attention kernel and recompute policy of the
real code, so that `petatrain profile` can hold the estimate to a measurement.

Units: bytes, FLOPs, seconds. `s` sequence length, `b` micro-batch (sequences), `h`
hidden size, `a` attention heads, `l` layers, `V` vocabulary, `t` tensor-parallel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from petatrain.config import JobConfig
from petatrain.errors import ConfigError

# ---------------------------------------------------------------------------------------
# Published formulas
# ---------------------------------------------------------------------------------------


def zero_model_state_bytes(
    params: float, stage: int, dp: int, *, weight_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12
) -> float:
    """Model-state memory per device under ZeRO-DP (Rajbhandari et al. 2020, §5.1-5.3, Figure 1).

    Mixed-precision Adam: 2Ψ fp16 weights + 2Ψ fp16 gradients + KΨ optimizer states (K = 12:
    fp32 master weights, momentum, variance). Stage 0 is plain data parallelism
    (2+2+K)Ψ; stage 1 (P_os) 4Ψ + KΨ/Nd; stage 2 (P_os+g) 2Ψ + (2+K)Ψ/Nd; stage 3
    (P_os+g+p) (2+2+K)Ψ/Nd.
    """
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"ZeRO stage must be 0-3 and dp >= 1, got stage={stage} dp={dp}")
    w = weight_bytes * params / (dp if stage >= 3 else 1)
    g = grad_bytes * params / (dp if stage >= 2 else 1)
    o = optimizer_bytes * params / (dp if stage >= 1 else 1)
    return w + g + o


def megatron_params(layers: int, h: int, V: int, s: int) -> float:
    """GPT parameter count, Narayanan et al. 2021 (Megatron-LM at scale), §5.1 / Appendix:
    P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    return 12 * layers * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * layers * h))


def megatron_flops_per_iteration(B: int, s: int, layers: int, h: int, V: int) -> float:
    """FLOPs per iteration with full activation recomputation, Narayanan et al. 2021, Appendix:
    F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)). (B is the global batch in sequences.)"""
    return 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))


def megatron_model_flops_per_iteration(B: int, s: int, layers: int, h: int, V: int) -> float:
    """Model FLOPs (no recomputation) per iteration, Korthikanti et al. 2022, §6:
    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    return 72 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (12 * layers * h))


def megatron_training_seconds(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """End-to-end training time estimate, Narayanan et al. 2021, §5.1: 8·T·P / (n·X)."""
    return 8 * tokens * params / (gpus * flops_per_gpu)


def palm_flops_per_token(n_params: float, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Model FLOPs per token for MFU, Chowdhery et al. 2022 (PaLM), Appendix B: 6N + 12·L·H·Q·T.

    The 12LHQT term is self-attention (forward + backward) over the full, unmasked T×T
    scores; 6N is the matmuls of the N parameters (forward 2N, backward 4N)."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation (PaLM, Appendix B): achieved model FLOP/s over peak FLOP/s."""
    return tokens_per_s * flops_per_token / peak_flops


def korthikanti_activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation memory of one transformer layer, Korthikanti et al. 2022, Table 2 (16-bit
    activations, dropout, materialised attention scores):

    - no parallelism:                 s·b·h·(34 + 5·a·s/h)
    - tensor parallel t:              s·b·h·(10 + 24/t + 5·a·s/(h·t))
    - tensor + sequence parallel:     s·b·h·(34 + 5·a·s/h) / t
    - selective recompute (+ TP, SP): 34·s·b·h / t
    - full recompute:                 2·s·b·h (the layer input only)
    """
    return layer_activation_bytes(
        s=s,
        b=b,
        h=h,
        a=a,
        ff=4 * h,
        e=2,
        dropout=True,
        attention="math",
        recompute=recompute,
        t=t,
        sp=sequence_parallel,
    )


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Share of a pipelined step spent idle: (p−1)/(v·m + p−1).

    GPipe (Huang et al. 2019, §2.3) and 1F1B (Narayanan et al. 2021, §2.2.1): p stages, m
    micro-batches; with v interleaved chunks per device the bubble shrinks by v.
    """
    return (p - 1) / (v * m + p - 1)


def bubble_overhead(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time, Narayanan et al. 2021, §2.2: (p−1)/m, interleaved (p−1)/(v·m)."""
    return (p - 1) / (v * m)


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Optimal compute time between checkpoints (Daly 2006, eq. 37; Young 1974 to first order):
    τ = √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else τ = M."""
    d, m = checkpoint_s, mtbf_s
    if d <= 0:
        return 0.0
    if d >= 2 * m:
        return m
    r = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(r) / 3 + r / 9) - d


def expected_goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Share of wall time that becomes kept progress (first-order, Young 1974 / Daly 2006):
    1 − δ/(τ+δ) − ((τ+δ)/2 + R)/M: checkpoint stalls, half an interval of lost work and a
    restart per failure."""
    if interval_s <= 0:
        return max(0.0, 1 - restart_s / mtbf_s)
    cycle = interval_s + checkpoint_s
    return max(0.0, 1 - checkpoint_s / cycle - (cycle / 2 + restart_s) / mtbf_s)


def kv_cache_bytes(*, batch: int, seq_len: int, n_layer: int, d_model: int, bytes_per_element: float = 2) -> float:
    """Inference KV cache: keys and values of every layer, 2·l·b·s·h elements (Pope et al. 2022, §3.1)."""
    return 2 * n_layer * batch * seq_len * d_model * bytes_per_element


def ring_allreduce_seconds(bytes_: float, n: int, bandwidth: float) -> float:
    """Ring all-reduce moves 2(n−1)/n of the buffer over each device's link (Patarasuk & Yuan 2009)."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * bytes_ / bandwidth


def ring_collective_seconds(bytes_: float, n: int, bandwidth: float) -> float:
    """Ring reduce-scatter or all-gather: (n−1)/n of the (full) buffer per device."""
    return 0.0 if n <= 1 else (n - 1) / n * bytes_ / bandwidth


# ---------------------------------------------------------------------------------------
# The accounting applied to petatrain's models as implemented
# ---------------------------------------------------------------------------------------


def layer_activation_bytes(
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    ff: int,
    e: float,
    dropout: bool,
    attention: str,
    recompute: str,
    t: int = 1,
    sp: bool = False,
    residual: float | None = None,
    mask_bytes: float = 1.0,
) -> float:
    """Saved activations of one pre-norm block, Korthikanti et al. 2022 §4 item by item,
    generalised to element width `e`, MLP width `ff`, dropout on or off, and SDPA/flash
    attention (which keeps its output and a fp32 log-sum-exp instead of the a·s² scores).

    `residual` is the width of the residual stream feeding the two LayerNorms (autocast
    keeps it in fp32); it defaults to `e`. Dropout masks are 1 byte per element with a
    fused kernel (CUDA's native_dropout); on CPU torch keeps a noise tensor as wide as the input.
    With e=2, dropout, math attention, ff=4h this is exactly the paper's Table 2.
    """
    r = e if residual is None else residual
    sbh = s * b * h
    shard = t  # tensors split by tensor parallelism
    repl = t if sp else 1  # tensors replicated unless sequence parallelism splits them
    if recompute == "full":
        return r * sbh / repl
    mask = mask_bytes if dropout else 0.0
    # Replicated under plain TP: the two LayerNorm inputs, the QKV and MLP inputs, two dropout masks.
    replicated = (2 * r + 2 * e + 2 * mask) * sbh
    # Split by TP: Q, K, V, the projection input, the GELU input and output.
    split = (4 * e + 2 * e * ff / h) * sbh
    if attention == "math":
        scores = (e + (mask + e if dropout else 0.0)) * a * s * s * b  # softmax out (+ mask + dropout out)
    else:
        scores = 4.0 * a * s * b  # flash/SDPA: fp32 log-sum-exp per row; the output is the proj input
    if recompute == "selective":
        scores = 0.0
    elif recompute != "none":
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    return replicated / repl + split / shard + scores / shard


@dataclass(kw_only=True, slots=True, frozen=True)
class Workload:
    """The model and batch a plan is for, read from a JobConfig."""

    kind: str
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    vocab_size: int
    seq_len: int
    dropout: float
    global_batch: int
    micro_batch: int
    precision: str
    optimizer: str
    recompute: str
    attention: str
    tokens: int
    strategy: str

    @classmethod
    def from_config(cls, cfg: JobConfig) -> Workload:
        m, tr = cfg.model, cfg.train
        if m.kind not in ("gpt", "mlp"):
            raise ConfigError(f"model.kind: plan estimates the built-in gpt and mlp, not {m.kind!r}")
        tokens = tr.tokens or tr.steps * tr.global_batch * m.seq_len
        return cls(
            kind=m.kind,
            n_layer=m.n_layer,
            n_head=m.n_head,
            d_model=m.d_model,
            d_ff=m.ff_dim,
            vocab_size=m.vocab_size,
            seq_len=m.seq_len,
            dropout=m.dropout,
            global_batch=tr.global_batch,
            micro_batch=tr.micro_batch,
            precision=tr.precision,
            optimizer=tr.optimizer,
            recompute=tr.activation_checkpointing if m.kind == "gpt" else "none",
            attention=tr.attention,
            tokens=tokens,
            strategy=cfg.parallel.strategy,
        )

    # --- parameters ------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        h, f = self.d_model, self.d_ff
        mlp = 2 * h + h * f + f + f * h + h  # LayerNorm + up + down (with biases)
        if self.kind == "mlp":
            return mlp
        return mlp + 2 * h + 3 * h * h + 3 * h + h * h + h  # + LayerNorm, qkv, proj

    @property
    def params(self) -> int:
        """All parameters, the tied head counted once (as models.count_params does)."""
        embed = self.vocab_size * self.d_model + (self.seq_len * self.d_model if self.kind == "gpt" else 0)
        return embed + self.n_layer * self.layer_params + 2 * self.d_model

    @property
    def params_non_embedding(self) -> int:
        """Parameters outside the token and position embeddings (Kaplan et al. 2020's N)."""
        return self.n_layer * self.layer_params + 2 * self.d_model

    @property
    def matmul_params(self) -> int:
        """Weights that multiply activations: every layer's matrices plus the (tied) output head."""
        h, f = self.d_model, self.d_ff
        per_layer = 2 * h * f + (4 * h * h if self.kind == "gpt" else 0)
        return self.n_layer * per_layer + h * self.vocab_size

    # --- FLOPs (per micro-batch of b sequences) ---------------------------------------
    def _attention_fwd_flops(self, b: int, *, executed: bool) -> float:
        """QKᵀ and PV: 2·2·b·s²·h unmasked; a causal flash kernel computes only s(s+1)/2 pairs."""
        if self.kind != "gpt":
            return 0.0
        s, h = self.seq_len, self.d_model
        pairs = s * (s + 1) / 2 if executed and self.attention == "sdpa" else s * s
        return 4 * b * h * pairs

    def model_flops(self, b: int) -> float:
        """PaLM model FLOPs (Appendix B) for b sequences: tokens·(6N + 12·L·H·Q·T), N = matmul weights."""
        per_token = 6 * self.matmul_params + (
            12 * self.n_layer * self.d_model * self.seq_len if self.kind == "gpt" else 0
        )
        return b * self.seq_len * per_token

    def executed_flops(self, b: int) -> float:
        """Matmul FLOPs the hardware runs for b sequences: forward, backward (2×), recomputation,
        causal attention as the kernel computes it (flash skips the masked half; math does not).
        Element-wise work (norms, softmax, GELU, the optimizer) is not counted, as in PaLM and Megatron."""
        s = self.seq_len
        block_mm = 2 * b * s * (self.matmul_params - self.d_model * self.vocab_size) / self.n_layer
        head = 2 * b * s * self.d_model * self.vocab_size
        attn = self._attention_fwd_flops(b, executed=True)
        forward = self.n_layer * (block_mm + attn) + head
        total = 3 * forward
        if self.recompute == "full":
            # torch's non-reentrant checkpoint stops recomputing once every saved tensor is
            # back: the MLP's down projection feeds only the residual add, so it is skipped.
            total += self.n_layer * (block_mm - 2 * b * s * self.d_ff * self.d_model + attn)
        elif self.recompute == "selective":
            total += self.n_layer * attn
        return total

    # --- memory ---------------------------------------------------------------------
    @property
    def activation_bytes_per_element(self) -> float:
        return 2.0 if self.precision == "bf16-mixed" else 4.0

    def layer_activations(self, b: int, *, cpu: bool = False, recompute: str | None = None) -> float:
        """Saved activations of one block for b sequences, as this code runs on a GPU or on the CPU."""
        e = self.activation_bytes_per_element
        if self.kind == "mlp":
            # LayerNorm input (residual, fp32 under autocast), up input, GELU input and output.
            sbh = self.seq_len * b * self.d_model
            return (4 + e + 2 * e * self.d_ff / self.d_model) * sbh
        dropout = self.dropout > 0
        # torch's CPU SDPA has no fused dropout: with dropout it takes the math path.
        attention = "math" if cpu and dropout else self.attention
        return layer_activation_bytes(
            s=self.seq_len,
            b=b,
            h=self.d_model,
            a=self.n_head,
            ff=self.d_ff,
            e=e,
            dropout=dropout,
            attention=attention,
            recompute=self.recompute if recompute is None else recompute,
            residual=4.0,  # the residual stream stays fp32 (fp32 training, or autocast's fp32 adds)
            mask_bytes=e if cpu else 1.0,
        )

    @property
    def largest_param(self) -> int:
        h, f = self.d_model, self.d_ff
        return max(self.vocab_size * h, h * f, 3 * h * h if self.kind == "gpt" else 0)


# Bytes per parameter of each model state, per training precision. bf16-mixed follows
# torch autocast: fp32 master weights and gradients, bf16 copies of the matmul weights
# made per step (counted under "other").
WEIGHT_BYTES = {"fp32": 4, "bf16-mixed": 4}
GRAD_BYTES = {"fp32": 4, "bf16-mixed": 4}
OPTIMIZER_BYTES = {"adamw": 8, "sgd": 4}  # Adam m and v in fp32; SGD momentum in fp32
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


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
    strategy: str,
    count: int,
    framework_overhead: float = 0.0,
    accumulation: int | None = None,
    cpu: bool = False,
) -> MemoryEstimate:
    """Peak memory of one device: the largest of the moments a training step goes through.

    Model states follow ZeRO's partitioning (zero_model_state_bytes) with torch's byte
    widths; activations follow layer_activation_bytes. The moments: the start of backward
    at the loss (all activations, the logits' gradients), a block's backward, a block's
    recomputation under full recompute, and the optimizer step. Gradients count at the
    forward/backward moments only when they outlive a micro-batch (accumulation, or a
    data-parallel wrapper's persistent buckets); otherwise they grow as activations free.
    `cpu` selects torch's CPU kernels (no fused dropout, single-tensor AdamW).
    """
    P = w.params
    b = w.micro_batch
    e = w.activation_bytes_per_element
    s, h, V = w.seq_len, w.d_model, w.vocab_size
    wb, gb, ob = WEIGHT_BYTES[w.precision], GRAD_BYTES[w.precision], OPTIMIZER_BYTES[w.optimizer]
    n = count
    if accumulation is None:
        accumulation = max(1, w.global_batch // (w.micro_batch * (1 if strategy == "pipeline" else n)))

    stage_layers = w.n_layer
    in_flight = 1
    shard = n
    if strategy == "pipeline":
        weights, grads, opt = wb * P / n, gb * P / n, ob * P / n
        stage_layers = math.ceil(w.n_layer / n)
        in_flight = min(n, accumulation)  # 1F1B: the first stage holds p micro-batches
    elif strategy == "ddp":
        weights, grads, opt = wb * P, gb * P, ob * P
        shard = 1
    elif strategy == "zero1":
        weights, grads, opt = wb * P, gb * P, ob * P / n
    elif strategy == "zero2":
        weights, grads, opt = wb * P, gb * P / n, ob * P / n
    elif strategy == "fsdp":
        weights, grads, opt = wb * P / n, gb * P / n, ob * P / n
    else:
        raise ConfigError(f"parallel.strategy: unknown strategy {strategy!r}")

    # Buffers that live through forward and backward.
    unit = w.layer_params
    buffers = 0.0
    if w.precision == "bf16-mixed" and strategy != "fsdp":
        # autocast's bf16 weight copies, kept for backward (FSDP gathers bf16 blocks instead).
        buffers += 2 * w.matmul_params * (stage_layers / w.n_layer)
    if strategy == "fsdp" and n > 1:
        buffers += 2 * unit * (2 if w.precision == "bf16-mixed" else 4)  # gathered current + prefetched block
        buffers += unit * gb  # the block's unsharded gradient before reduce-scatter
    if strategy in ("ddp", "zero1", "zero2") and n > 1:
        buffers += min(2 * DDP_BUCKET_BYTES, gb * P)  # buckets being reduced while backward goes on

    sbh = s * b * h
    layer = w.layer_activations(b, cpu=cpu)
    acts = in_flight * stage_layers * layer + (e * sbh if w.dropout > 0 and cpu else sbh if w.dropout > 0 else 0)
    tail = 2 * 4 * sbh + 8 * s * b  # final LayerNorm input and output (fp32), token ids
    head = 12 * s * b * V  # fp32 log-softmax output, its gradient and the logits' gradient
    block_bwd = (1 + 2 * w.d_ff / h) * e * sbh  # incoming gradient + two MLP-wide gradients in a block's backward
    persistent = weights + opt
    grads_live = grads if (accumulation > 1 or n > 1) else 0.0
    layer_grads = gb * unit / shard if strategy != "pipeline" else gb * unit

    moments = [
        # (name, gradients, activations, temporaries)
        ("backward at the loss", grads_live, acts + tail, head),
        ("backward of the last block", grads_live, acts, block_bwd),
    ]
    if w.recompute == "full":
        # One block rebuilt during backward, plus its incoming gradient, its output and the
        # two residual-branch outputs the recomputation makes on the way (measured: 4 × e·sbh).
        block = w.layer_activations(b, cpu=cpu, recompute="none")
        first = max(grads_live, grads - layer_grads) if stage_layers > 1 else grads_live
        moments = [
            ("backward at the loss", grads_live, acts + tail, head),
            ("recompute of the last block", grads_live, acts, block + 4 * e * sbh),
            ("recompute of the first block", first, acts / stage_layers, block + 4 * e * sbh),
        ]
    # Optimizer step: CPU AdamW runs tensor by tensor (two temporaries the size of the
    # largest tensor); on a GPU the foreach kernels make one fp32 temporary of all of them.
    if w.optimizer == "adamw":
        opt_temp = 2 * 4 * w.largest_param if cpu else 4 * P / shard
    else:
        opt_temp = 0.0
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
