"""A decoder-only transformer (GPT), small enough to read in one sitting.

Pre-norm blocks, causal self-attention through SDPA (or the materialised-scores "math"
path the planner also models), GELU MLP, learned positions, output head tied to the token
embedding. Activation checkpointing: "full" recomputes whole blocks, "selective"
recomputes only the attention core (Korthikanti et al.).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from petatrain.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str, selective: bool):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.attention = attention
        self.selective = selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tensor parallelism qkv's output is this rank's heads' q|k|v (FusedColwise): the
        # widths below are the local ones, C / degree.
        q, k, v = self.qkv(x).chunk(3, dim=2)  # (B, T, C) each
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if self.selective and self.training:
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.proj(y)

    def prefill(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Self-attention of one sequence's T new positions (1, T, C) that follow none: their keys
        and values written to `keys` / `values` (H, S, D, one cache row) at positions 0..T-1."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        keys[:, :T], values[:, :T] = k[0], v[0]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def decode(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One new position per row (B, 1, C), row b's at `lengths[b]` after the cached ones
        (keys / values (B, H, S, D)). Every product is computed row by row (`rowwise`), so a row's
        numbers do not depend on which other rows share the batch."""
        B, _, C = x.shape
        H, S = self.n_head, keys.size(2)
        q, k, v = rowwise(self.qkv, x).split(C, dim=2)
        q, k, v = (t.view(B, H, 1, C // H) for t in (q, k, v))  # (B, H, 1, D)
        rows = torch.arange(B, device=x.device)
        keys[rows, :, lengths], values[rows, :, lengths] = k[:, :, 0], v[:, :, 0]
        scores = torch.bmm(q.reshape(B * H, 1, -1), keys.reshape(B * H, S, -1).transpose(1, 2))
        scores = scores.view(B, H, 1, S) / math.sqrt(C // H)
        seen = torch.arange(S, device=x.device)[None, :] <= lengths[:, None]  # (B, S): the cached and the new
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf")).softmax(dim=-1)
        y = torch.bmm(scores.reshape(B * H, 1, S), values.reshape(B * H, S, -1)).view(B, H, 1, C // H)
        return rowwise(self.proj, y.transpose(1, 2).reshape(B, 1, C))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return F.dropout(scores.softmax(dim=-1), p) @ v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ff_dim)
        self.down = nn.Linear(cfg.ff_dim, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: str, selective: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, attention, selective)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))

    def prefill(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.prefill(self.ln1(x), keys, values)
        return x + self.mlp(self.ln2(x))

    def decode(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.decode(self.ln1(x), keys, values, lengths)
        mlp = self.mlp
        return x + rowwise(mlp.down, F.gelu(rowwise(mlp.up, self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, *, attention: str = "sdpa", activation_checkpointing: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.full_recompute = activation_checkpointing == "full"
        selective = activation_checkpointing == "selective"
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attention, selective) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    # Pipeline stages (train/pipeline/): the modules before the blocks, the blocks, the modules after.
    FIRST = ("wte", "wpe", "drop")
    LAST = ("ln_f", "head")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = self.run_block(block, x)
        return self.finish(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, x, use_reentrant=False) if self.full_recompute and self.training else block(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))  # (B, T, vocab)

    # Generation with a KV cache (serve/): a token costs one position's forward, not the prefix's.
    def new_cache(self, rows: int) -> KVCache:
        """Keys and values for `rows` sequences of up to the model's context (fixed shapes: a row's
        numbers do not depend on the others' lengths)."""
        cfg, p = self.cfg, next(self.parameters())
        shape = (rows, cfg.n_head, cfg.seq_len, cfg.d_model // cfg.n_head)
        return KVCache(
            keys=[p.new_zeros(shape) for _ in self.blocks], values=[p.new_zeros(shape) for _ in self.blocks],
            lengths=torch.zeros(rows, dtype=torch.long, device=p.device),
        )  # fmt: skip

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, cache: KVCache, row: int) -> torch.Tensor:
        """Run a prompt (1-D ids) into cache row `row`; the next token's logits (vocab,)."""
        x = self.embed(ids.unsqueeze(0))
        for block, keys, values in zip(self.blocks, cache.keys, cache.values, strict=True):
            x = cast(Block, block).prefill(x, keys[row], values[row])
        cache.lengths[row] = ids.numel()
        return self.head(self.ln_f(x[0, -1]))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per cache row (B,), each at its row's next position; the logits after it (B, vocab)."""
        pos = cache.lengths
        x = (self.wte(tokens) + self.wpe(pos)).unsqueeze(1)  # (B, 1, C)
        for block, keys, values in zip(self.blocks, cache.keys, cache.values, strict=True):
            x = cast(Block, block).decode(x, keys, values, pos)
        cache.lengths = pos + 1
        return rowwise(self.head, self.ln_f(x))[:, 0]


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per block: (rows, heads, context, head dim)
    values: list[torch.Tensor]
    lengths: torch.Tensor  # (rows,): positions filled


def rowwise(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear` on (B, 1, in) as B products of one row each (a batched matmul): the same numbers
    for a row whatever B is, where one (B, in) product may sum in another order for another B."""
    B = x.size(0)
    weight = linear.weight.t().expand(B, *linear.weight.t().shape)
    if linear.bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(linear.bias.expand(B, 1, -1), x, weight)


class TokenMLP(nn.Module):
    """Next-token MLP: each position sees only its own token (a learned bigram model with depth)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Residual(nn.LayerNorm(cfg.d_model), MLP(cfg)) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(_init_weights)

    FIRST = ("wte",)
    LAST = ("ln_f", "head")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.finish(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)  # (B, T, C)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))  # (B, T, vocab)


class Residual(nn.Sequential):
    """x + layers(x): the residual inside the block, so a pipeline stage boundary may fall between
    any two blocks (parameter names as an nn.Sequential's: checkpoints of either read alike)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]; tokens is (B, T+1)."""
    return logits_loss(model(tokens[:, :-1]), tokens[:, 1:])


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, vocab) logits against (B, T) targets: the last pipeline stage's loss."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.8, seed: int = 0):
    """Sample `new_tokens` after `prompt` (1-D); deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    cfg: Any = model.cfg  # a ModelConfig for the built-in models; any object with seq_len for a user's
    seq_len = int(cfg.seq_len)
    out = prompt.clone()
    for _ in range(new_tokens):
        logits = model(out[-seq_len:].unsqueeze(0))[0, -1].float() / temperature
        nxt = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=gen)
        out = torch.cat([out, nxt.to(out.device)])
    return out


def gpt_tensor_plan(cfg: ModelConfig) -> Any:
    """The GPT's tensor-parallel plan (Megatron's, with sequence parallelism as torchtitan lays it):
    attention heads split across ranks (q|k|v by column, the output projection by row), the MLP by
    column then row, the token embedding and the tied head by vocabulary, the loss over the
    vocabulary-sharded logits; between blocks the residual stream is split by sequence position,
    and the layer norms run on those positions. The embedding's sum is whole on every rank and
    split at the first block (the learned positions are not vocabulary-split)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from petatrain.models.tensor_parallel import FusedColwise, Replicated, TensorPlan

    def styles(degree: int) -> dict[str, Any]:
        return {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "wpe": Replicated(),
            "blocks.0": PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
            ),
            "blocks.*.ln1": SequenceParallel(),
            # The attention and the MLP get their input as a DTensor (use_local_output=False): its
            # gradient then leaves them Partial and is reduce-scattered back to the positions' split;
            # a local tensor made the column-parallel layer all-reduce it first (twice the bytes).
            "blocks.*.attn": PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=False
            ),
            "blocks.*.attn.qkv": FusedColwise(3),
            "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "blocks.*.ln2": SequenceParallel(),
            "blocks.*.mlp": PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=False
            ),
            "blocks.*.mlp.up": ColwiseParallel(),
            "blocks.*.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }

    divisible = {
        "model.n_head": cfg.n_head,
        "model.ff_dim": cfg.ff_dim,
        "model.vocab_size": cfg.vocab_size,
        "model.seq_len (sequence parallelism splits positions)": cfg.seq_len,
    }
    return TensorPlan(styles=styles, divisible=divisible, loss_parallel=True)
