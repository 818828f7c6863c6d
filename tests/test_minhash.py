import random

import numpy as np
import pyarrow as pa
import pytest

from petatrain.data import synth
from petatrain.data.ingest.minhash import LSHParams, band_keys, estimate_jaccard, signatures


def _pair(share: float, seed: int = 0) -> tuple[str, str]:
    rng = random.Random(seed)
    words = synth._Words(rng)
    base = synth._document(words, rng, 300)
    return base, synth.mutate(base, rng, words, share)


@pytest.mark.parametrize("share", [0.01, 0.05, 0.15])
def test_signature_estimate_tracks_true_jaccard(share):
    a, b = _pair(share)
    params = LSHParams.for_threshold(0.8)
    sig = signatures(pa.array([a, b]), params)
    true = synth.jaccard(a, b)
    assert abs(estimate_jaccard(sig[0], sig[1]) - true) < 0.08, true


def test_signatures_do_not_depend_on_batching():
    texts = [_pair(0.1, seed)[i] for seed in range(5) for i in range(2)] + ["short text", ""]
    params = LSHParams.for_threshold(0.8)
    whole = signatures(pa.array(texts), params)
    one_by_one = np.concatenate([signatures(pa.array([t]), params) for t in texts])
    assert np.array_equal(whole, one_by_one)
    assert np.array_equal(band_keys(whole, params), band_keys(one_by_one, params))


def test_lsh_parameters_catch_high_similarity_and_skip_low():
    params = LSHParams.for_threshold(0.8)
    assert params.bands * params.rows <= params.num_perm
    assert params.collision_probability(0.85) > 0.99
    assert params.collision_probability(0.3) < 0.01


def test_threshold_is_validated():
    with pytest.raises(ValueError, match="threshold"):
        LSHParams.for_threshold(1.2)
