"""Dedup correctness on a corpus with planted exact and near duplicates."""

import json

import pytest

from helpers import duplicates, ingest, read_dataset
from petatrain.data import synth

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def near_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("near") / "ds"
    summary = ingest(corpus.files, out, dedup="near", shard_size="300KB")
    return summary, set(read_dataset(out).column("text").to_pylist()), out


def test_near_dedup_recall_and_precision(corpus, near_run):
    _, kept, _ = near_run
    high = [(a, b) for a, b, j in corpus.near_pairs if j >= 0.85 and a != b]
    assert len(high) >= 30, "the corpus should plant enough near pairs to measure recall"
    caught = sum(1 for a, b in high if a in kept and b not in kept)
    assert caught / len(high) >= 0.95, f"recall {caught}/{len(high)}"
    # Pairs below 0.5 are related documents, not duplicates: both survive.
    low = [(a, b) for a, b, j in corpus.far_pairs if j < 0.5]
    assert low, "the corpus should plant dissimilar related pairs"
    merged = [(a, b) for a, b in low if a not in kept or b not in kept]
    assert not merged


def test_exact_duplicates_keep_the_earliest_copy(corpus, near_run):
    summary, kept, out = near_run
    for original, _ in corpus.exact_pairs:
        assert original in kept
    table = read_dataset(out)
    texts = table.column("text").to_pylist()
    assert len(texts) == len(set(texts))
    ids = table.column("doc_id").to_pylist()
    assert ids == sorted(ids), "rows keep input order"
    dups = duplicates(out)
    assert all(o > d for o, d in zip(dups.column("ord").to_pylist(), dups.column("dup_of").to_pylist(), strict=True))
    assert summary.exact_duplicates >= len(corpus.exact_pairs)
    assert (
        summary.rows_out + summary.exact_duplicates + summary.near_duplicates + sum(summary.rejected.values())
        == summary.rows_in
    )


def test_exact_mode_keeps_near_duplicates(corpus, tmp_path):
    summary = ingest(corpus.files, tmp_path / "ds", dedup="exact")
    kept = set(read_dataset(tmp_path / "ds").column("text").to_pylist())
    assert summary.near_duplicates == 0 and summary.exact_duplicates > 0
    assert all(b in kept for a, b, j in corpus.near_pairs if a != b)


def test_duplicates_across_files_keep_the_first_file(tmp_path):
    docs = [
        synth._document(synth._Words(__import__("random").Random(i)), __import__("random").Random(i), 80)
        for i in range(3)
    ]
    for name, order in (("a.jsonl", [0, 1]), ("b.jsonl", [2, 0, 1])):
        (tmp_path / name).write_text("".join(json.dumps({"text": docs[i]}) + "\n" for i in order))
    ingest([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], tmp_path / "ds")
    table = read_dataset(tmp_path / "ds")
    assert table.column("text").to_pylist() == [docs[0], docs[1], docs[2]]
    assert [i >> 36 for i in table.column("doc_id").to_pylist()] == [0, 0, 1]


def test_dedup_decisions_do_not_depend_on_partitioning(corpus, tmp_path):
    """The map-reduce gives the same drops for any number of partitions and groups."""
    import glob

    import pyarrow.parquet as pq

    from petatrain.config import IngestConfig
    from petatrain.data.ingest import dedup
    from petatrain.data.ingest.minhash import LSHParams
    from petatrain.data.ingest.stages import FILE_BITS, ReadCleanSign, whole_file

    lsh = LSHParams.for_threshold(0.8)
    stage = ReadCleanSign(staging=str(tmp_path / "stg"), cfg=IngestConfig(), options=None, lsh=lsh)
    for i, path in enumerate(corpus.files):
        stage(whole_file(i, path, 0))
    sigs = sorted(glob.glob(str(tmp_path / "stg" / "sigs" / "*.parquet")))
    results = []
    for partitions, groups in ((2, 2), (5, 7)):
        out = tmp_path / f"dups-{partitions}"
        plan = dedup.DedupPlan(mode="near", params=lsh, first_new=0, partitions=partitions)
        dedup.find_duplicates(sigs, plan, groups_url=str(out), num_groups=groups, file_bits=FILE_BITS, options=None)
        rows = sorted(
            r for f in sorted(out.iterdir()) for r in pq.read_table(f).to_pylist() for r in [tuple(r.values())]
        )
        results.append(rows)
    assert results[0] == results[1] and len(results[0]) > 50
