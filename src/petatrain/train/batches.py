"""The training loop's data: micro-batches of token sequences from the petatrain loader, and
the held-out split it evaluates on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from petatrain.config import JobConfig
from petatrain.errors import ConfigError
from petatrain.storage import StorageOptions


def held_out(cfg: JobConfig, n_shards: int) -> int:
    """Shards held out for evaluation with data.eval_split "shards": the last `data.eval_shards`,
    when the dataset has more (none with the "rows" split)."""
    if cfg.data.eval_split != "shards":
        return 0
    return cfg.data.eval_shards if n_shards > cfg.data.eval_shards else 0


def training_samples(cfg: JobConfig, rows: list[int]) -> int:
    """Samples of one epoch of the training split of a dataset whose shards hold `rows` rows."""
    import numpy as np

    from petatrain.data.loading.heldout import HeldOut

    if cfg.data.eval_split == "rows":
        if not cfg.data.eval_fraction:
            return sum(rows)
        return int(HeldOut(np.asarray(rows, np.int64), cfg.data.eval_fraction).train_counts().sum())
    return sum(rows[: len(rows) - held_out(cfg, len(rows))])


def check_dataset(cfg: JobConfig, url: str, manifest: Any) -> None:
    """ConfigError (one line) for a dataset the model cannot train on, from its manifest alone (so
    the driver says it before anything starts): rows of packed tokens at least `seq_len + 1` long,
    a vocabulary within the model's."""
    from petatrain.data import index as idx

    seq = cfg.model.seq_len + 1
    kind = manifest.column_type("tokens")
    if not (kind and kind.startswith("fixed_size_binary[")):
        raise ConfigError(
            f"{url} has no packed tokens column: ingest it with --tokenizer and --pack-length {seq} (model.seq_len + 1)"
        )
    width = int(kind[len("fixed_size_binary[") : -1]) // idx.token_dtype(url, manifest).itemsize
    if width < seq:
        raise ConfigError(
            f"model.seq_len {cfg.model.seq_len} needs rows of >= {seq} tokens; {url} has {width} "
            f"(ingest with --pack-length {seq})"
        )
    vocab = manifest.tokenizer.vocab_size if manifest.tokenizer else None
    if vocab and vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} is below the dataset's vocabulary ({vocab})")


class TokenBatches:
    """Micro-batches of token sequences from the petatrain loader, rolling over epochs.

    The held-out split is `data.eval_split`'s: a share of every shard's rows (stable across the
    dataset's versions), or its last `data.eval_shards` shards; training reads the rest. The state
    is the loader's JSON state.
    """

    def __init__(self, cfg: JobConfig, *, rank: int, world: int, micro: int, options: StorageOptions | None):
        from petatrain.data import index as idx
        from petatrain.data.loading.stream import StreamingDataset

        url = cfg.data.dataset
        n_shards = idx.open_dataset(url, options).manifest.totals.shards
        held = held_out(cfg, n_shards)
        fraction = cfg.data.eval_fraction if cfg.data.eval_split == "rows" else 0.0
        self.cfg, self.micro, self.seq = cfg, micro, cfg.model.seq_len + 1

        def loader(**split: Any) -> StreamingDataset:
            return StreamingDataset(
                url, rank=rank, world_size=world, batch_size=micro, columns=["tokens"], options=options,
                cache_dir=cfg.data.cache_dir or None, held_out=fraction, **split,
            )  # fmt: skip

        self.train = loader(seed=cfg.data.seed, drop_last=True, shards=(0, n_shards - held) if held else None)
        self.eval: StreamingDataset | None = None
        if held:
            self.eval = loader(shuffle=False, shards=(n_shards - held, n_shards))
        elif fraction:
            self.eval = loader(shuffle=False, split="eval")
            if not self.eval.num_samples:
                self.eval = None
        check_dataset(cfg, url, self.train.manifest)
        if len(self.train) < micro:
            raise ConfigError(f"{url}: fewer than train.micro_batch samples per rank in the training split")
        self.consumed = 0
        self.wait_s = 0.0
        self._it: Iterator[dict[str, Any]] | None = None

    def next(self) -> torch.Tensor:
        t0 = time.perf_counter()
        while True:
            if self._it is None:
                self._it = self.train.iter_batches()
            batch = next(self._it, None)
            if batch is not None:
                break
            self.train.set_epoch(self.train.epoch + 1)
            self.consumed, self._it = 0, None
        self.consumed += len(batch["index"])
        self.wait_s += time.perf_counter() - t0
        return torch.as_tensor(batch["tokens"])[:, : self.seq].to(torch.long)  # (B, T+1)

    def state_dict(self) -> dict[str, Any]:
        return self.train.state_dict(consumed=self.consumed)

    def load_state_dict(self, state: dict[str, Any], *, carry_replay: float | None = None) -> None:
        """Continue at the state's position; with `carry_replay`, a position in an earlier version
        of the dataset is first carried onto this one (`train --continue`) with that replay share."""
        if carry_replay is not None:
            state = self.train.carried_over(state, carry_replay)
        self.train.load_state_dict(state)
        self.consumed, self._it = 0, None

    def eval_batches(self, n: int):
        if self.eval is None:
            return
        for i, batch in enumerate(self.eval.iter_batches()):
            if i >= n:
                return
            yield torch.as_tensor(batch["tokens"])[:, : self.seq].to(torch.long)
