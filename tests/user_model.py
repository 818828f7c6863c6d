"""A user model for the `model.kind: package.module:factory` test."""

from torch import nn


def build(cfg):
    model = nn.Sequential(nn.Embedding(cfg.vocab_size, 16), nn.Linear(16, cfg.vocab_size))

    def loss_fn(module, tokens):
        logits = module(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return model, loss_fn


def not_a_model(cfg):
    return "nope"


def build_tp(cfg):
    """A user model that declares its own tensor-parallel plan: the embedding split by vocabulary,
    the MLP by column then row, the head by vocabulary (its logits gathered for a plain loss)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from petatrain.models.tensor_parallel import TensorPlan

    width = 32
    model = nn.Sequential(
        nn.Embedding(cfg.vocab_size, 16), nn.Linear(16, width), nn.GELU(), nn.Linear(width, 16),
        nn.Linear(16, cfg.vocab_size),
    )  # fmt: skip

    def loss_fn(module, tokens):
        logits = module(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def styles(degree):
        return {
            "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "1": ColwiseParallel(),
            "3": RowwiseParallel(),
            "4": ColwiseParallel(output_layouts=Replicate()),
        }

    plan = TensorPlan(styles=styles, divisible={"the hidden width": width, "model.vocab_size": cfg.vocab_size})
    return model, loss_fn, plan
