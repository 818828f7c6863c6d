"""Synthetic corpora with planted duplicates and bad records, for the demo, tests and benchmarks.

Nothing is downloaded: documents are sentences drawn from a generated vocabulary with a
Zipf-like word distribution, so 5-gram shingles of unrelated documents rarely collide.
Near duplicates are made by replacing a share of a base document's words, and the pair's
true Jaccard similarity (over word 5-gram shingles) is recorded so tests can check recall.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
from dataclasses import dataclass, field

_WORD = re.compile(r"\w+")


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / max(1, len(sa | sb))


@dataclass
class Corpus:
    """What was generated: file paths and the planted duplicate pairs (by document text)."""

    files: list[str] = field(default_factory=list)
    documents: int = 0
    exact_pairs: list[tuple[str, str]] = field(default_factory=list)
    near_pairs: list[tuple[str, str, float]] = field(default_factory=list)  # (original, copy, jaccard)
    far_pairs: list[tuple[str, str, float]] = field(default_factory=list)  # related but < 0.5
    bad_records: int = 0
    bytes: int = 0


class _Words:
    def __init__(self, rng: random.Random, vocab_size: int = 30000):
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(vocab_size)]
        self.cum_weights = list(itertools.accumulate(1.0 / (i + 10) for i in range(vocab_size)))
        self.rng = rng

    def draw(self, n: int) -> list[str]:
        return self.rng.choices(self.vocab, cum_weights=self.cum_weights, k=n)


def _document(words: _Words, rng: random.Random, mean_words: int) -> str:
    n = max(20, int(rng.gauss(mean_words, mean_words / 3)))
    tokens = words.draw(n)
    out, sentence = [], []
    for w in tokens:
        sentence.append(w)
        if len(sentence) >= rng.randint(8, 20):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def mutate(text: str, rng: random.Random, words: _Words, share: float) -> str:
    """Replace about `share` of the words (spread out), keeping punctuation."""
    parts = text.split(" ")
    for i in range(len(parts)):
        if rng.random() < share:
            parts[i] = words.draw(1)[0]
    return " ".join(parts)


def generate(
    out_dir: str,
    *,
    documents: int = 2000,
    files: int = 4,
    mean_words: int = 150,
    exact_rate: float = 0.05,
    near_rate: float = 0.05,
    far_rate: float = 0.02,
    bad_records: bool = True,
    seed: int = 0,
) -> Corpus:
    """Write `files` JSONL files with `documents` unique documents plus planted copies."""
    rng = random.Random(seed)
    words = _Words(rng)
    os.makedirs(out_dir, exist_ok=True)
    corpus = Corpus()
    docs: list[str] = []
    for _ in range(documents):
        docs.append(_document(words, rng, mean_words))
        roll = rng.random()
        base = docs[-1]
        if roll < exact_rate:
            docs.append(base)
            corpus.exact_pairs.append((base, base))
        elif roll < exact_rate + near_rate:
            # Replace ~1.5% of words: ~7% of 5-grams change, Jaccard ~0.86-0.95.
            copy = mutate(base, rng, words, rng.uniform(0.005, 0.02))
            docs.append(copy)
            corpus.near_pairs.append((base, copy, jaccard(base, copy)))
        elif roll < exact_rate + near_rate + far_rate:
            copy = mutate(base, rng, words, rng.uniform(0.15, 0.3))
            docs.append(copy)
            corpus.far_pairs.append((base, copy, jaccard(base, copy)))
    # Copies sit right after their originals within a file, or in a later file: both
    # orders of appearance must keep the earlier one.
    per_file = (len(docs) + files - 1) // files
    for f in range(files):
        path = os.path.join(out_dir, f"part-{f:03d}.jsonl")
        with open(path, "wb") as handle:
            for i, text in enumerate(docs[f * per_file : (f + 1) * per_file]):
                handle.write(json.dumps({"text": text, "id": f"{f}-{i}"}).encode() + b"\n")
                if bad_records and i % 97 == 13:
                    handle.write(_bad_record(i, rng))
                    corpus.bad_records += 1
        corpus.files.append(path)
        corpus.bytes += os.path.getsize(path)
    corpus.documents = len(docs)
    return corpus


def _bad_record(i: int, rng: random.Random) -> bytes:
    kind = i % 5
    if kind == 0:
        return b'{"text": "unterminated\n'
    if kind == 1:
        return json.dumps({"body": "no text field here"}).encode() + b"\n"
    if kind == 2:
        return b'{"text": "bad \xff\xfe bytes"}\n'
    if kind == 3:
        return json.dumps({"text": "   \t  "}).encode() + b"\n"
    return json.dumps({"text": 12345}).encode() + b"\n"
