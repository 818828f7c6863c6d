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
