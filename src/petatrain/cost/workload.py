"""The model and batch a plan is for (`Workload`), read from a JobConfig, and what the
implementation stores per element: the leaf that estimators and strategies share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from petatrain.config import JobConfig
from petatrain.cost.formulas import layer_activation_bytes
from petatrain.errors import ConfigError


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

    @property
    def weight_width(self) -> int:
        """Bytes per parameter of the weights (fp32 masters under bf16-mixed)."""
        return WEIGHT_BYTES[self.precision]

    @property
    def grad_width(self) -> int:
        return GRAD_BYTES[self.precision]

    @property
    def optimizer_width(self) -> int:
        return OPTIMIZER_BYTES[self.optimizer]

    @property
    def gathered_width(self) -> int:
        """Bytes per parameter of weights gathered for compute (FSDP's bf16 param_dtype under bf16-mixed)."""
        return 2 if self.precision == "bf16-mixed" else 4

    def with_micro_batch(self, micro_batch: int) -> Workload:
        return dataclasses.replace(self, micro_batch=micro_batch)

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
