"""Attacks tried on a fresh clone, as an attacker and as a careless user would; each stays tried here.

Stale or tampered caches, concurrent writers, foreign folders, tampered indexes. Every
attack must end in one of: the right bytes, a clear one-line error, or a quarantine
record, and never in a committed dataset losing data.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from helpers import ingest, read_dataset, snapshot
from petatrain.data import StreamingDataset, index, synth
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage import atomic_write, checksum_bytes, join, read_bytes
from petatrain.storage.lock import Lease, LeaseHeld, LeaseLost

pytestmark = pytest.mark.usefixtures("ray_local")


def _corpus(root, tag, files=2, documents=200):
    return synth.generate(str(root / f"raw-{tag}"), documents=documents, files=files, bad_records=False, seed=tag).files


def _tokens(url, cache_dir, prefetch=True):
    ds = StreamingDataset(str(url), shuffle=False, batch_size=16, cache_dir=str(cache_dir), prefetch=prefetch)
    return np.concatenate([b["tokens"].numpy() for b in ds]), sorted(os.listdir(cache_dir))


def _token_ds(root, tag, out=None):
    out = out or root / f"ds-{tag}"
    ingest(_corpus(root, tag), out, dedup="exact", tokenizer="bytes", pack_length=32, shard_size="8KB")
    return out


# -- 1. the node-local shard cache ---------------------------------------------------------
def test_cache_never_serves_a_flipped_bit(tmp_path):
    url, cache = _token_ds(tmp_path, 11), tmp_path / "cache"
    first, _ = _tokens(url, cache)
    cached = [p for p in (cache).glob("*.parquet")]
    assert cached
    for path in cached:  # one flipped bit in the middle of every cached shard
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    again, _ = _tokens(url, cache)
    np.testing.assert_array_equal(again, first)
    repaired, _ = _tokens(url, cache)  # and the cache now holds the right bytes again
    np.testing.assert_array_equal(repaired, first)


def test_a_write_just_after_a_cached_shard_was_hashed_is_not_taken_as_verified(tmp_path, monkeypatch):
    """Seen once in the suite: the next epoch's prefetch thread hashed a cached shard, the bit flip above
    landed before that thread set the shard's time (LRU recency) and remembered its stat after that as
    verified, and the flipped bit was served. A write between the hash and the stat remembered is a
    change: here every shard is flipped right after the first hash of the second epoch. (Without
    prefetch threads: a shard already mapped and verified when its file is rewritten in place shows the
    new bytes to its reader, which no check at open can catch.)"""
    from petatrain.data.loading import cache as cache_module

    url, cache = _token_ds(tmp_path, 12), tmp_path / "cache"
    first, _ = _tokens(url, cache, prefetch=False)  # fetched (and verified) into the cache
    hashed = cache_module.checksum_bytes
    flipped: list[bool] = []

    def hash_then_flip(data):
        digest = hashed(data)
        if not flipped:
            flipped.append(True)
            for path in cache.glob("*.parquet"):
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0x01
                path.write_bytes(bytes(data))
        return digest

    monkeypatch.setattr(cache_module, "checksum_bytes", hash_then_flip)
    again, _ = _tokens(url, cache, prefetch=False)
    monkeypatch.undo()
    assert flipped
    np.testing.assert_array_equal(again, first)
    later, _ = _tokens(url, cache, prefetch=False)
    np.testing.assert_array_equal(later, first)


def test_cache_follows_a_dataset_replaced_at_the_same_url(tmp_path):
    url, cache = tmp_path / "ds", tmp_path / "cache"
    _token_ds(tmp_path, 21, out=url)
    old, _ = _tokens(url, cache)
    for root, dirs, files in os.walk(url, topdown=False):  # the user deletes the dataset ...
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            os.rmdir(os.path.join(root, name))
    os.rmdir(url)
    _token_ds(tmp_path, 22, out=url)  # ... and ingests other data at the same URL
    new, _ = _tokens(url, cache)
    expected, _ = _tokens(url, tmp_path / "fresh-cache")
    assert not np.array_equal(new[: len(old)], old[: len(new)])
    np.testing.assert_array_equal(new, expected)


# -- 2. concurrent writers -----------------------------------------------------------------
def _rows(url):
    return sorted(read_dataset(url).column("text").to_pylist())


def _race(out, sources):
    """Two appends started together; returns (summaries of those that committed, errors)."""
    results: dict[int, object] = {}

    def one(tag):
        try:
            results[tag] = ingest(sources[tag], out, dedup="none", append=True)
        except PetatrainError as exc:
            results[tag] = exc

    threads = [threading.Thread(target=one, args=(tag,)) for tag in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results.values() if not isinstance(r, Exception)]
    lost = [r for r in results.values() if isinstance(r, Exception)]
    assert won and len(lost) <= 1, results
    for error in lost:
        assert "in use by another ingest" in str(error) and "\n" not in str(error)
    return won, lost


def test_two_concurrent_ingests_keep_every_row_or_refuse_one(tmp_path):
    out = tmp_path / "ds"
    won, _ = _race(out, {tag: _corpus(tmp_path, tag, files=1) for tag in (31, 32)})
    assert len(_rows(out)) == sum(s.rows_out for s in won)
    assert run_cli("inspect", str(out), "--verify").returncode == 0


def test_an_ingest_refuses_a_dataset_another_holds_and_touches_nothing(tmp_path):
    out = tmp_path / "ds"
    ingest(_corpus(tmp_path, 41, files=1), out, dedup="none")
    before = snapshot(out)
    with Lease(join(str(out), "_lock"), kind="ingest"), pytest.raises(LeaseHeld, match="in use by another ingest"):
        ingest(_corpus(tmp_path, 42, files=1), out, dedup="none", append=True)
    assert snapshot(out) == before


def test_an_expired_lease_of_a_dead_ingest_is_taken_over(tmp_path):
    out = tmp_path / "ds"
    os.makedirs(out)
    dead = {"owner": "dead", "kind": "ingest", "host": "h", "pid": 1, "since": 0.0, "expires": time.time() - 1}
    (out / "_lock").write_text(json.dumps(dead))
    summary = ingest(_corpus(tmp_path, 43, files=1), out, dedup="none")
    assert summary.rows_out > 0 and not (out / "_lock").exists()


def test_a_lease_whose_holder_here_is_dead_or_a_zombie_is_taken_at_once_a_live_ones_is_not(tmp_path):
    """A holder on this host that was killed is not waited out for its 60 s. Killed by an orchestrator's
    shim that exits without waiting for it, it stays a zombie where nothing reaps it: it answers
    signals (os.kill(pid, 0)) but renews nothing, so it counts as dead too."""
    import socket
    import subprocess

    from petatrain.storage.lock import _zombie

    url = str(tmp_path / "ds" / "_lock")
    os.makedirs(tmp_path / "ds")
    child = subprocess.Popen(["true"])  # exits at once; not waited for: a zombie, still signalable
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _zombie(child.pid):
            time.sleep(0.01)
        here = {"kind": "ingest", "host": socket.gethostname(), "since": 0.0, "expires": time.time() + 60}
        (tmp_path / "ds" / "_lock").write_text(json.dumps({**here, "owner": "zombie", "pid": child.pid}))
        with Lease(url, kind="ingest"):
            pass
        alive = subprocess.Popen(["sleep", "30"])
        try:
            (tmp_path / "ds" / "_lock").write_text(json.dumps({**here, "owner": "alive", "pid": alive.pid}))
            with pytest.raises(LeaseHeld, match=f"pid {alive.pid}"):
                Lease(url, kind="ingest").acquire()
        finally:
            alive.kill()
            alive.wait()
    finally:
        child.wait()


def test_a_manifest_changed_under_an_ingest_is_not_overwritten(tmp_path, monkeypatch):
    """The lease is the lock; the manifest's generation is the fence if a lease was lost."""
    out = tmp_path / "ds"
    ingest(_corpus(tmp_path, 44, files=1), out, dedup="none")
    rows = _rows(out)
    from petatrain.data.ingest import pipeline as ingest_mod

    real_commit = ingest_mod._commit

    def racing_commit(job, manifest, *args, **kwargs):
        stolen = index.read_manifest(str(out))  # another writer commits meanwhile
        stolen.generation += 1
        index.write_manifest(str(out), stolen)
        return real_commit(job, manifest, *args, **kwargs)

    monkeypatch.setattr(ingest_mod, "_commit", racing_commit)
    with pytest.raises(PetatrainError, match="changed while this ingest ran"):
        ingest(_corpus(tmp_path, 45, files=1), out, dedup="none", append=True)
    assert _rows(out) == rows


# -- 6. a folder that is not ours ----------------------------------------------------------
def test_ingest_into_a_foreign_folder_is_refused_untouched(tmp_path):
    out = tmp_path / "mine"
    (out / "data").mkdir(parents=True)
    (out / "data" / "part-000000.parquet").write_bytes(b"my own file")
    (out / "notes.txt").write_text("do not delete")
    before = snapshot(out)
    result = run_cli("ingest", *_corpus(tmp_path, 51, files=1), "--out", str(out), "--dedup", "none")
    assert result.returncode != 0
    assert "not a petatrain dataset" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert snapshot(out) == before


def test_a_crashed_first_ingest_can_be_rerun(tmp_path):
    """What a first ingest leaves before its manifest is ours: a rerun may clean it up."""
    out = tmp_path / "ds"
    sources = _corpus(tmp_path, 52, files=1)
    from petatrain.data.ingest import pipeline as ingest_mod

    original = index.write_manifest

    def crash(*args, **kwargs):
        raise RuntimeError("crash before the commit")

    ingest_mod.idx.write_manifest = crash
    try:
        with pytest.raises(RuntimeError):
            ingest(sources, out, dedup="none")
    finally:
        ingest_mod.idx.write_manifest = original
    assert ingest(sources, out, dedup="none").rows_out > 0


# -- 7, 8. a tampered index ----------------------------------------------------------------
@pytest.fixture
def text_ds(tmp_path):
    out = tmp_path / "ds"
    ingest(_corpus(tmp_path, 61, files=2, documents=300), out, dedup="none", shard_size="16KB")
    return out


def _rewrite_index(url, change, *, fix_checksum):
    """Tamper with the shard index; with `fix_checksum` the attacker also updates the manifest."""
    manifest = json.loads(read_bytes(join(str(url), index.MANIFEST)))
    path = join(str(url), manifest["index"]["path"])
    rows = change(pq.read_table(path).to_pylist())
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=index.SHARD_SCHEMA), sink)
    data = sink.getvalue().to_pybytes()
    atomic_write(path, data)
    if fix_checksum:
        manifest["index"].update(checksum=checksum_bytes(data), bytes=len(data))
        atomic_write(join(str(url), index.MANIFEST), json.dumps(manifest).encode())


def _negative_first_shard(rows):
    rows[0]["rows"] = -5  # the loader skipped a 15k-row shard silently and trained on
    return rows


def test_a_tampered_shard_index_is_caught(text_ds):
    _rewrite_index(text_ds, _negative_first_shard, fix_checksum=False)
    with pytest.raises(CorruptDataError, match="shard index"):
        StreamingDataset(str(text_ds))
    result = run_cli("inspect", str(text_ds), "--verify")
    assert result.returncode != 0 and "shard index" in result.stderr


def test_impossible_row_counts_are_caught_even_with_a_matching_checksum(text_ds):
    _rewrite_index(text_ds, _negative_first_shard, fix_checksum=True)
    with pytest.raises(CorruptDataError, match="rows"):
        StreamingDataset(str(text_ds))


def test_verify_compares_row_counts(text_ds):
    manifest = json.loads(read_bytes(join(str(text_ds), index.MANIFEST)))
    manifest["totals"]["rows"] = 10**9
    atomic_write(join(str(text_ds), index.MANIFEST), json.dumps(manifest).encode())
    result = run_cli("inspect", str(text_ds), "--verify")
    assert result.returncode != 0
    assert "rows" in (result.stdout + result.stderr)


def test_a_changed_tokenizer_dtype_is_caught(tmp_path):
    url = _token_ds(tmp_path, 62)
    manifest = json.loads(read_bytes(join(str(url), index.MANIFEST)))
    manifest["tokenizer"]["dtype"] = "uint32"
    atomic_write(join(str(url), index.MANIFEST), json.dumps(manifest).encode())
    with pytest.raises(CorruptDataError, match="dtype"):
        StreamingDataset(str(url))


def test_shard_paths_must_stay_inside_the_dataset(text_ds, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not yours")

    def escape(rows):
        rows[0]["path"] = "../secret.txt"
        rows[0]["checksum"] = checksum_bytes(secret.read_bytes())
        rows[0]["bytes"] = len(secret.read_bytes())
        return rows

    _rewrite_index(text_ds, escape, fix_checksum=True)
    with pytest.raises(CorruptDataError, match="outside the dataset"):
        list(StreamingDataset(str(text_ds), shuffle=False))
    result = run_cli("inspect", str(text_ds), "--verify")
    assert result.returncode != 0 and "outside the dataset" in result.stderr


# -- on the S3 server ----------------------------------------------------------------------
@pytest.mark.s3
def test_two_concurrent_appends_on_s3_keep_every_row_or_refuse_one(s3_bucket, tmp_path):
    out = join(s3_bucket, "ds")
    first = ingest(_corpus(tmp_path, 71, files=1), out, dedup="none")
    won, _ = _race(out, {tag: _corpus(tmp_path, tag, files=1) for tag in (72, 73)})
    assert len(read_dataset(out)) == first.rows_out + sum(s.rows_out for s in won)
    assert not index.verify_shards(index.open_dataset(out))


def _lease_takeover(url):
    """One holder; a second writer is refused; once the first stops renewing, its lease is taken
    over and the first finds out before it publishes anything."""
    first = Lease(url, kind="ingest", ttl_s=1.0)
    first.acquire()
    with pytest.raises(LeaseHeld, match="in use by another ingest"):
        Lease(url, kind="ingest", ttl_s=1.0).acquire()
    time.sleep(1.5)  # renewed meanwhile: still held
    with pytest.raises(LeaseHeld):
        Lease(url, kind="ingest", ttl_s=1.0).acquire()
    first._stop.set()  # the holder stalls: no more renewals
    first._thread.join()
    time.sleep(1.2)
    with Lease(url, kind="ingest", ttl_s=1.0), pytest.raises(LeaseLost, match="lost the lease"):
        first.check()
    with Lease(url, kind="ingest", ttl_s=1.0):  # released: free again
        pass


def test_the_lease_on_a_local_disk(tmp_path):
    _lease_takeover(str(tmp_path / "ds" / "_lock"))


@pytest.mark.s3
def test_the_lease_on_s3(s3_bucket):
    _lease_takeover(join(s3_bucket, "ds", "_lock"))
