"""Models: the built-in GPT and MLP, and user models named `package.module:factory`.

A user factory is called with the `ModelConfig` and returns `(module, loss_fn)` where
`loss_fn(module, tokens)` gives the scalar loss of a `(batch, seq_len + 1)` int64 tensor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from petatrain.config import ModelConfig, TrainConfig
from petatrain.errors import ConfigError
from petatrain.models.gpt import GPT, TokenMLP, next_token_loss

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class ModelSpec:
    module: nn.Module
    loss_fn: LossFn
    block_types: tuple[type[nn.Module], ...] = ()  # units FSDP shards one by one
    # Forward and backward never write the parameters (only optimizer.step does), so a
    # checkpoint may be written from the live tensors while the next step's forward and
    # backward run. Known for the built-in models only; a user model's weights are copied.
    weights_fixed_in_forward: bool = False


def build_model(model: ModelConfig, train: TrainConfig | None = None) -> ModelSpec:
    """Build the configured model on the CPU with the current torch RNG state."""
    train = train or TrainConfig()
    if model.kind == "gpt":
        module = GPT(model, attention=train.attention, activation_checkpointing=train.activation_checkpointing)
        from petatrain.models.gpt import Block

        return ModelSpec(module, next_token_loss, (Block,), weights_fixed_in_forward=True)
    if model.kind == "mlp":
        return ModelSpec(TokenMLP(model), next_token_loss, (), weights_fixed_in_forward=True)
    module_name, _, attr = model.kind.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.kind: cannot load {model.kind!r} ({exc})") from None
    built = factory(model)
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module) and callable(built[1])):
        raise ConfigError(f"model.kind: {model.kind} must return (torch.nn.Module, loss_fn)")
    return ModelSpec(built[0], built[1], ())


def count_params(module: nn.Module) -> int:
    """Parameters counted once even when tied."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
