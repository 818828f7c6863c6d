"""Tokenisers (Hugging Face `tokenizers`, nothing downloaded) and fixed-length packing.

Token ids are stored as fixed-width little-endian binary (uint16 when the vocabulary
fits, else uint32) so a reader turns a row into a tensor with `torch.frombuffer`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from petatrain.errors import PetatrainError

EOS = "<|endoftext|>"


def byte_level() -> Tokenizer:
    """256 byte tokens + EOS: no training, every string encodes losslessly."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained locally on `texts`."""
    if vocab_size < 300:
        raise PetatrainError(f"--tokenizer train:{vocab_size}: vocabulary must be >= 300 (256 bytes + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load(spec: str, sample: Iterable[str] | None = None) -> Tokenizer:
    """'bytes', 'train:VOCAB' (trained on `sample`) or a tokenizer.json path."""
    if spec == "bytes":
        return byte_level()
    if spec.startswith("train:"):
        try:
            vocab = int(spec.split(":", 1)[1])
        except ValueError:
            raise PetatrainError(f"--tokenizer {spec}: expected train:VOCAB, e.g. train:8000") from None
        return train_bpe(sample or [], vocab)
    try:
        tok = Tokenizer.from_file(spec)
    except Exception as exc:
        raise PetatrainError(
            f"--tokenizer {spec}: not 'bytes', 'train:N' or a readable tokenizer.json ({exc})"
        ) from None
    return tok


def eos_id(tok: Tokenizer) -> int:
    eos = tok.token_to_id(EOS)
    if eos is None:
        tok.add_special_tokens([EOS])
        eos = tok.token_to_id(EOS)
    assert eos is not None, "a token just added has an id"
    return eos


def token_dtype(tok: Tokenizer) -> np.dtype:
    return np.dtype("<u2") if tok.get_vocab_size(with_added_tokens=True) <= 65535 else np.dtype("<u4")


def byte_table(tok: Tokenizer) -> np.ndarray | None:
    """For a byte-level tokenizer without merges, the id of each byte value (else None).

    Such a tokenizer maps every UTF-8 byte to one token, so a 256-entry table encodes
    a text with one numpy gather instead of a trip through the BPE machinery (~50x).
    """
    spec = json.loads(tok.to_str())
    model = spec.get("model", {})
    if (
        model.get("type") != "BPE"
        or model.get("merges")
        or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel"
    ):
        return None
    alphabet = _bytes_to_unicode()
    ids = [tok.token_to_id(alphabet[b]) for b in range(256)]
    return None if any(i is None for i in ids) else np.asarray(ids, dtype=token_dtype(tok))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def encode(tok: Tokenizer, texts: list[str], table: np.ndarray | None = None) -> list[np.ndarray]:
    """Token ids per text; `table` (from `byte_table`) takes the fast path for byte tokenizers."""
    if table is not None:
        return [table[np.frombuffer(t.encode("utf-8"), dtype=np.uint8)] for t in texts]
    dtype = token_dtype(tok)
    return [np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def pack(docs: list[np.ndarray], length: int, eos: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """Concatenate documents with EOS after each and cut into rows of `length` tokens.

    Returns (rows[n, length], tokens left over). The tail shorter than a row is not
    padded: it is reported as left over, so every stored token is real.
    """
    if not docs:
        return np.empty((0, length), dtype=dtype), 0
    eos_arr = np.asarray([eos], dtype=dtype)
    stream = np.concatenate([part for doc in docs for part in (doc, eos_arr)])
    rows = len(stream) // length
    return stream[: rows * length].reshape(rows, length), len(stream) - rows * length
