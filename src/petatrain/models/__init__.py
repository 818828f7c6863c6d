"""Models: the built-in GPT and MLP, and user models named `package.module:factory`.

A user factory is called with the `ModelConfig` and returns `(module, loss_fn)` where
`loss_fn(module, tokens)` gives the scalar loss of a `(batch, seq_len + 1)` int64 tensor, or
`(module, loss_fn, PipelineParts)` to let `parallel.strategy: pipeline` split it into stages; a
`TensorPlan` (models/tensor_parallel.py) after them lets `parallel.tensor` split its layers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from petatrain.config import ModelConfig, TrainConfig
from petatrain.errors import ConfigError
from petatrain.models.gpt import GPT, TokenMLP, gpt_tensor_plan, logits_loss, next_token_loss
from petatrain.models.tensor_parallel import TensorPlan

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class PipelineParts:
    """How a model splits into pipeline stages: `module.embed(tokens)` (run by the first stage, with
    the modules named in `first`), the blocks in `module.<blocks>` (an nn.ModuleList), and
    `module.finish(hidden)` (the last stage, with the modules in `last`); `output_loss(outputs,
    targets)` is the last stage's loss. A block may be run through `module.run_block(block, x)`
    where the model defines it (activation checkpointing)."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    output_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class ModelSpec:
    module: nn.Module
    loss_fn: LossFn
    block_types: tuple[type[nn.Module], ...] = ()  # units FSDP shards one by one
    # Forward and backward never write the parameters (only optimizer.step does), so a
    # checkpoint may be written from the live tensors while the next step's forward and
    # backward run. Known for the built-in models only; a user model's weights are copied.
    weights_fixed_in_forward: bool = False
    pipeline: PipelineParts | None = None  # None: the model cannot be split into stages
    tensor: TensorPlan | None = None  # None: the model has no tensor-parallel plan


def build_model(model: ModelConfig, train: TrainConfig | None = None) -> ModelSpec:
    """Build the configured model on the CPU with the current torch RNG state."""
    train = train or TrainConfig()
    if model.kind == "gpt":
        module = GPT(model, attention=train.attention, activation_checkpointing=train.activation_checkpointing)
        from petatrain.models.gpt import Block

        parts = PipelineParts("blocks", GPT.FIRST, GPT.LAST, logits_loss)
        return ModelSpec(
            module, next_token_loss, (Block,), weights_fixed_in_forward=True, pipeline=parts,
            tensor=gpt_tensor_plan(model),
        )  # fmt: skip
    if model.kind == "mlp":
        parts = PipelineParts("layers", TokenMLP.FIRST, TokenMLP.LAST, logits_loss)
        return ModelSpec(TokenMLP(model), next_token_loss, (), weights_fixed_in_forward=True, pipeline=parts)
    module_name, _, attr = model.kind.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.kind: cannot load {model.kind!r} ({exc})") from None
    built = factory(model)
    extras = built[2:] if isinstance(built, tuple) else ()
    pieces = [e for e in extras if isinstance(e, PipelineParts)]
    plans = [e for e in extras if isinstance(e, TensorPlan)]
    if not (
        isinstance(built, tuple)
        and len(built) in (2, 3, 4)
        and isinstance(built[0], nn.Module)
        and callable(built[1])
        and len(pieces) <= 1
        and len(plans) <= 1
        and len(pieces) + len(plans) == len(extras)
    ):
        raise ConfigError(
            f"model.kind: {model.kind} must return (torch.nn.Module, loss_fn[, PipelineParts][, TensorPlan])"
        )
    return ModelSpec(built[0], built[1], (), pipeline=pieces[0] if pieces else None, tensor=plans[0] if plans else None)


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (the GPT's `wte.weight` and `head.weight`)."""
    model = getattr(model, "module", model)  # DDP's wrapper: the names without its prefix
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def count_params(module: nn.Module) -> int:
    """Parameters counted once even when tied."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
