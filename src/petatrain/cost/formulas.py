"""Published formulas, each a small pure function citing its paper and unit-tested against the
paper's own numbers (tests/test_plan.py); `layer_activation_bytes` generalises Korthikanti et
al. 2022 to petatrain's element widths, attention kernels and recompute policies.

Units: bytes, FLOPs, seconds. `s` sequence length, `b` micro-batch (sequences), `h`
hidden size, `a` attention heads, `l` layers, `V` vocabulary, `t` tensor-parallel size.
"""

from __future__ import annotations


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
