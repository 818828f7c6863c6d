"""MinHash signatures and LSH band keys over word 5-gram shingles, vectorised per batch.

A batch of documents is hashed in a few numpy passes instead of one Python call per
shingle: words are split and dictionary-encoded by Arrow, only the distinct words of the
batch are hashed in Python, and the n-gram hashes, permutations and per-document minima
are array operations. The permutations are multiply-shift hashes of 32-bit shingle
hashes (a*x mod 2^32 with odd a, top 16 bits kept): one multiply per value on numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

_SEED = 0x5EED_9E7A  # fixed: signatures must be comparable across runs and appends
_CHUNK_COLS = 4096  # shingles per permutation block: (perms, 4096) uint32 stays in cache


@dataclass(frozen=True, slots=True)
class LSHParams:
    """Bands x rows layout of a MinHash signature, derived from a Jaccard threshold."""

    threshold: float
    num_perm: int
    bands: int
    rows: int
    ngram: int = 5

    @classmethod
    def for_threshold(cls, threshold: float, *, num_perm: int | None = None, ngram: int = 5) -> LSHParams:
        """Pick bands and rows for `threshold`, weighting missed duplicates over false candidates.

        False candidates are cheap (every candidate pair is verified against the signature
        estimate afterwards) while a missed pair is lost for good, hence the 1:19 weighting.
        """
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"near-dedup threshold must be in (0, 1), got {threshold}")
        num_perm = num_perm or num_perm_for(threshold)
        best = None
        for bands in range(1, num_perm + 1):
            rows = num_perm // bands
            fp = _integrate(lambda s, b=bands, r=rows: 1 - (1 - s**r) ** b, 0.0, threshold)
            fn = _integrate(lambda s, b=bands, r=rows: (1 - s**r) ** b, threshold, 1.0)
            cost = 0.05 * fp + 0.95 * fn
            if best is None or cost < best[0]:
                best = (cost, bands, rows)
        assert best is not None  # num_perm >= 1
        _, bands, rows = best
        return cls(threshold=threshold, num_perm=num_perm, bands=bands, rows=rows, ngram=ngram)

    def collision_probability(self, jaccard: float) -> float:
        return 1 - (1 - jaccard**self.rows) ** self.bands


def _integrate(f, a: float, b: float, steps: int = 200) -> float:
    h = (b - a) / steps
    return sum(f(a + (i + 0.5) * h) for i in range(steps)) * h


def _permutations(num_perm: int) -> np.ndarray:
    """Odd 32-bit multipliers: x -> a*x mod 2^32 permutes 32-bit shingle hashes, and its
    top bits are a multiply-shift hash of x."""
    rng = np.random.Generator(np.random.PCG64(_SEED))
    return (rng.integers(0, 2**31, size=num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)).astype(np.uint32)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads n-gram sums over all 64 bits (in place on a copy)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def shingle_hashes(texts: pa.Array, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of the word n-grams of each text, and each text's start offset.

    Words are lower-cased runs of word characters. A text with fewer than `ngram` words
    contributes one shingle made of all its words, so short texts still compare.
    Returns (hashes uint64[n_shingles], starts int64[n_texts]); every text has >= 1 shingle.
    """
    # Punctuation becomes a separator, then ASCII whitespace splits: 3x faster than a
    # regex split on \W+ (non-ASCII spaces stay inside words, which only shifts shingles).
    words = pc.ascii_split_whitespace(pc.replace_substring_regex(pc.utf8_lower(texts), r"[^\w\s]+", " "))
    flat = pc.list_flatten(words)
    offsets = words.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    if isinstance(words, pa.ChunkedArray):  # pragma: no cover - callers pass Arrays
        raise TypeError("shingle_hashes expects an Array, not a ChunkedArray")
    # Empty strings come from leading/trailing separators; give them hash 0 and drop them.
    encoded = pc.dictionary_encode(flat)
    vocab = encoded.dictionary.to_pylist()
    vocab_hash = np.fromiter(
        (xxhash.xxh3_64_intdigest(w.encode()) if w else 0 for w in vocab), dtype=np.uint64, count=len(vocab)
    )
    word_hash = vocab_hash[encoded.indices.to_numpy(zero_copy_only=False)]
    keep = word_hash != 0
    # Rebuild per-text offsets after dropping empty words.
    kept_before = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
    offsets = kept_before[offsets]
    word_hash = word_hash[keep]
    n_words = np.diff(offsets)

    # n-gram hash = mix(sum_k w[i+k] * P^(ngram-1-k)); positions whose window crosses a
    # text boundary are discarded below.
    total = len(word_hash)
    acc = np.zeros(max(total - ngram + 1, 0), dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    for k in range(ngram):
        acc *= prime
        acc += word_hash[k : k + len(acc)]
    window_ok = np.zeros(len(acc), dtype=bool)
    n_sh = np.where(n_words >= ngram, n_words - ngram + 1, 1)
    starts = np.concatenate([[0], np.cumsum(n_sh)[:-1]]).astype(np.int64)
    long_docs = np.nonzero(n_words >= ngram)[0]
    # Mark valid window starts: [offset, offset + n_words - ngram] for long texts.
    if len(long_docs):
        begin = offsets[long_docs]
        end = begin + n_words[long_docs] - ngram + 1
        marks = np.zeros(len(acc) + 1, dtype=np.int64)
        np.add.at(marks, begin, 1)
        np.add.at(marks, end, -1)
        window_ok = np.cumsum(marks[:-1]) > 0
    out = np.empty(int(n_sh.sum()), dtype=np.uint64)
    if len(long_docs):
        long_mask = n_words >= ngram
        idx = np.repeat(long_mask, n_sh)
        out[idx] = acc[window_ok]
    short_docs = np.nonzero(n_words < ngram)[0]
    if len(short_docs):
        # Whole-text shingle: the sum of its (few) word hashes, position-weighted.
        csum = np.concatenate([[np.uint64(0)], np.cumsum(word_hash * np.uint64(0x9E3779B97F4A7C15))])
        vals = csum[offsets[short_docs + 1]] - csum[offsets[short_docs]]
        out[starts[short_docs]] = vals + n_words[short_docs].astype(np.uint64)
    return _mix64(out), starts


def signatures(texts: pa.Array, params: LSHParams) -> np.ndarray:
    """MinHash signatures, uint16[n_texts, num_perm]: the top 16 bits of each minimum.

    16 bits per value halve what is stored and shuffled; two different minima agree by
    chance with probability 2^-16, a negligible bias on the similarity estimate.

    Layout (perms, shingles) so the per-text minimum is a `reduceat` along contiguous
    rows: ~10x faster than (shingles, perms) on numpy.
    """
    hashes, starts = shingle_hashes(texts, params.ngram)
    hashes = (hashes >> np.uint64(32)).astype(np.uint32)
    a = _permutations(params.num_perm)
    n_texts = len(starts)
    sig = np.empty((params.num_perm, n_texts), dtype=np.uint32)
    ends = np.append(starts[1:], len(hashes))
    doc = 0
    buf = np.empty((params.num_perm, _CHUNK_COLS), dtype=np.uint32)
    while doc < n_texts:
        lo = starts[doc]
        last = max(int(np.searchsorted(ends, lo + _CHUNK_COLS, side="right")), doc + 1)
        hi = ends[last - 1]
        width = hi - lo
        # One very long text may exceed a chunk: it gets a block of its own.
        block = buf[:, :width] if width <= _CHUNK_COLS else np.empty((params.num_perm, width), np.uint32)
        np.multiply(a[:, None], hashes[None, lo:hi], out=block)
        sig[:, doc:last] = np.minimum.reduceat(block, starts[doc:last] - lo, axis=1)
        doc = last
    return (sig.T >> np.uint32(16)).astype(np.uint16)


def band_keys(sig: np.ndarray, params: LSHParams) -> np.ndarray:
    """64-bit key per (text, band), uint64[n_texts, bands]; the band index is mixed in."""
    n = sig.shape[0]
    used = sig[:, : params.bands * params.rows].reshape(n, params.bands, params.rows)
    acc = np.arange(params.bands, dtype=np.uint64)[None, :].repeat(n, axis=0)
    prime = np.uint64(0x100000001B3)
    for j in range(params.rows):
        acc *= prime
        acc += used[:, :, j].astype(np.uint64)
    return _mix64(acc.reshape(-1)).reshape(n, params.bands)


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """Share of equal signature positions, row-wise."""
    return (sig_a == sig_b).mean(axis=-1)


def num_perm_for(threshold: float) -> int:
    """Signature length whose estimate has a standard error of ~2.5% at the threshold."""
    var = threshold * (1 - threshold)
    return int(min(256, max(64, 16 * math.ceil(var / 0.025**2 / 16))))
