"""The streaming loader's promises: exactly once, a pure order, elastic resume, verified bytes."""

import json
import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers import ingest, start_ranks
from petatrain.data import StreamingDataset, loader, synth
from petatrain.errors import CorruptDataError, PetatrainError

pytestmark = pytest.mark.usefixtures("ray_local")
BATCH = 8


@pytest.fixture(scope="module")
def token_ds(tmp_path_factory):
    """~1000 packed token rows in ~12 shards."""
    root = tmp_path_factory.mktemp("stream")
    corpus = synth.generate(str(root / "raw"), documents=600, files=3, mean_words=60, bad_records=False, seed=3)
    ingest(corpus.files, root / "ds", dedup="exact", tokenizer="bytes", pack_length=64, shard_size="20KB")
    return str(root / "ds")


def _indices(ds, workers):
    dl = DataLoader(ds, batch_size=ds.batch_size, num_workers=workers)
    return [int(i) for batch in dl for i in batch["index"]]


def _rank_sets(url, world, workers, **kw):
    return [
        _indices(StreamingDataset(url, rank=r, world_size=world, batch_size=BATCH, **kw), workers) for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_exactly_once_per_epoch(token_ds, world, workers):
    ranks = _rank_sets(token_ds, world, workers, seed=5, columns=["tokens"])
    flat = [i for r in ranks for i in r]
    total = StreamingDataset(token_ds).num_samples
    assert total > 500
    assert sorted(flat) == list(range(total))
    assert max(map(len, ranks)) - min(map(len, ranks)) <= 1


def test_order_is_pure_and_independent_of_workers(token_ds):
    runs = [_rank_sets(token_ds, 2, workers, seed=11) for workers in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2]
    again = _rank_sets(token_ds, 2, 0, seed=11)
    assert again == runs[0]
    other_epoch = _rank_sets(token_ds, 2, 0, seed=11, epoch=1)
    assert other_epoch != runs[0]
    unshuffled = _rank_sets(token_ds, 1, 0, shuffle=False)[0]
    assert unshuffled == list(range(len(unshuffled)))
    shuffled = runs[0][0] + runs[0][1]
    assert shuffled != sorted(shuffled)


def test_samples_carry_the_right_tokens(token_ds):
    ds = StreamingDataset(token_ds, shuffle=False, columns=["tokens"])
    sample = next(iter(ds))
    assert sample["index"] == 0 and sample["tokens"].dtype == torch.uint16 and sample["tokens"].shape == (64,)
    batch = next(iter(loader(token_ds, batch_size=4, num_workers=0, seed=2)))
    assert batch["tokens"].shape == (4, 64) and batch["index"].dtype == torch.int64
    plain = StreamingDataset(token_ds, shuffle=False)
    rows = {s["index"]: s["tokens"] for s in plain}
    for i, tokens in zip(batch["index"].tolist(), batch["tokens"], strict=True):
        assert torch.equal(rows[i], tokens)


def test_drop_last_cuts_an_equal_tail_and_counts_it(token_ds):
    ranks = _rank_sets(token_ds, 3, 0, seed=1, drop_last=True)
    ds = StreamingDataset(token_ds, rank=0, world_size=3, batch_size=BATCH, drop_last=True, seed=1)
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) % BATCH == 0
    assert sum(map(len, ranks)) + ds.dropped == ds.num_samples
    assert ds.dropped < 3 * BATCH


def _consume(url, world, workers, state, batches_per_rank=None, seed=7):
    """Run `world` lockstep ranks from `state`; returns per-rank indices and rank 0's state."""
    loaders = [
        loader(url, batch_size=BATCH, num_workers=workers, rank=r, world_size=world, seed=seed) for r in range(world)
    ]
    seen = [[] for _ in range(world)]
    iters = []
    for dl in loaders:
        if state:
            dl.load_state_dict(json.loads(json.dumps(state)))  # the state is plain JSON
        iters.append(iter(dl))
    steps = 0
    while batches_per_rank is None or steps < batches_per_rank:
        got = [next(it, None) for it in iters]
        if all(g is None for g in got):
            break
        for r, g in enumerate(got):
            if g is not None:
                seen[r].extend(g["index"].tolist())
        steps += 1
    return seen, loaders[0].state_dict()


@pytest.mark.parametrize("seed", range(6))
def test_resume_with_other_layouts_is_exactly_once(token_ds, seed):
    rng = random.Random(seed)
    world, workers = rng.choice([1, 2, 3, 4]), rng.choice([0, 1, 2])
    total = StreamingDataset(token_ds).num_samples
    per_rank_batches = total // (world * BATCH)
    cut = rng.randint(1, max(1, per_rank_batches - 1))
    before, state = _consume(token_ds, world, workers, None, batches_per_rank=cut)
    assert len(json.dumps(state)) < 400
    new_world, new_workers = rng.choice([1, 2, 3, 4]), rng.choice([0, 1, 2])
    after, _ = _consume(token_ds, new_world, new_workers, state)
    consumed = [i for r in before + after for i in r]
    assert sorted(consumed) == list(range(total)), (world, workers, cut, new_world, new_workers)


def test_resume_with_the_same_layout_continues_the_same_sequence(token_ds):
    full, _ = _consume(token_ds, 2, 1, None)
    part, state = _consume(token_ds, 2, 2, None, batches_per_rank=5)
    rest, _ = _consume(token_ds, 2, 0, state)
    assert [a + b for a, b in zip(part, rest, strict=True)] == full


def test_state_for_another_dataset_or_seed_is_refused(token_ds):
    dl = loader(token_ds, batch_size=BATCH, num_workers=0, seed=1)
    state = dl.state_dict()
    other = loader(token_ds, batch_size=BATCH, num_workers=0, seed=2)
    with pytest.raises(PetatrainError, match="seed=1"):
        other.load_state_dict(state)
    with pytest.raises(PetatrainError, match="samples"):
        other.load_state_dict({**state, "seed": 2, "num_samples": 3})


def test_corrupt_or_missing_shard_is_a_clear_error(token_ds, tmp_path):
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(token_ds, copy)
    shards = sorted((copy / "data").iterdir())
    data = bytearray(shards[2].read_bytes())
    data[200] ^= 0x40
    shards[2].write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=f"shard corrupt: {shards[2]}"):
        list(StreamingDataset(str(copy), shuffle=False))
    shards[3].unlink()
    with pytest.raises(CorruptDataError, match="shard missing"):
        list(StreamingDataset(str(copy), seed=3))
    with pytest.raises(PetatrainError, match="no column 'nope'"):
        StreamingDataset(str(copy), columns=["nope"])


def test_wait_time_is_counted(token_ds):
    dl = loader(token_ds, batch_size=BATCH, num_workers=1)
    assert sum(1 for _ in dl) == len(dl)
    assert dl.wait_seconds > 0


def _ranked_worker(rank, world, url, port, out):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dl = loader(url, batch_size=BATCH, num_workers=1, seed=9)  # rank and world size from torch.distributed
        mine = [i for b in dl for i in b["index"].tolist()]
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, mine)
        if rank == 0:
            with open(out, "w") as handle:
                json.dump(gathered, handle)
    finally:
        torch.distributed.destroy_process_group()
    os._exit(0)  # not through finalization, which can race gloo's worker thread: see test_checkpoint.py


@pytest.mark.slow
def test_real_gloo_ranks_read_each_sample_once(token_ds, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "gathered.json"
    start_ranks(_ranked_worker, (3, token_ds, port, str(out)), 3)
    gathered = json.loads(out.read_text())
    assert sorted(i for r in gathered for i in r) == list(range(StreamingDataset(token_ds).num_samples))
    assert gathered == _rank_sets(token_ds, 3, 0, seed=9)


@pytest.mark.slow  # ~9 s: a 10M-row index written and opened
def test_order_scales_to_ten_million_shards(tmp_path):
    """Opening a 10M-shard index holds arrays the size of the index, never of the samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from petatrain.data import index as idx
    from petatrain.data.manifest import Column, Lineage, Manifest, Totals

    n = 10_000_000
    rows = np.full(n, 1000, dtype=np.int64)
    table = pa.table(
        {
            "path": pa.array(np.char.add("data/part-", np.arange(n).astype(str)).astype(object), pa.string()),
            "rows": rows,
            "bytes": np.full(n, 4_000_000, dtype=np.int64),
            "checksum": pa.array(["xxh3-128:0"] * n, pa.string()),
            "first_row": np.arange(n, dtype=np.int64) * 1000,
        }
    )
    (tmp_path / "_index").mkdir()
    pq.write_table(table, tmp_path / "_index" / "shards.parquet")
    del table
    manifest = Manifest(
        kind="tokens",
        totals=Totals(shards=n, rows=n * 1000),
        schema=[Column("tokens", "fixed_size_binary[4096]")],
        lineage=Lineage(),
    )
    idx.write_manifest(str(tmp_path), manifest)
    ds = StreamingDataset(str(tmp_path), rank=5, world_size=64, batch_size=32, seed=1)
    assert ds.num_samples == 10_000_000_000
    order = ds.order()
    positions = ds.deal().positions(0, 32)
    shards, within = order.locate(positions)
    assert ((within >= 0) & (within < 1000)).all() and len(np.unique(shards)) > 1
    assert order.shard_order.nbytes + order.ends.nbytes <= 2 * 8 * n


def test_prefetch_thread_errors_reach_the_consumer(token_ds, tmp_path):
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(token_ds, copy)
    for shard in (copy / "data").iterdir():
        shard.write_bytes(b"garbage")
    dl = loader(str(copy), batch_size=BATCH, num_workers=0)
    with pytest.raises(CorruptDataError, match="shard corrupt"):
        next(iter(dl))


def test_breaking_out_early_stops_the_prefetch_threads(token_ds):
    import threading
    import time

    def prefetching() -> bool:
        return any(t.name.startswith("petatrain-prefetch") for t in threading.enumerate())

    deadline = time.time() + 5
    while prefetching() and time.time() < deadline:  # other tests' loaders wind down first
        time.sleep(0.05)
    assert not prefetching()
    dl = loader(token_ds, batch_size=BATCH, num_workers=0)
    for i, _ in enumerate(dl):
        if i == 2:
            assert prefetching()
            break
    deadline = time.time() + 5
    while prefetching() and time.time() < deadline:
        time.sleep(0.05)
    assert not prefetching()


def test_the_next_epoch_starts_loading_in_this_one_and_reads_the_same(token_ds, monkeypatch):
    """Near an epoch's end the next epoch's first window starts loading in a reader of its own;
    taking it over changes no sample. Anything else (the same epoch again, a restored state,
    a copy in another process) starts afresh, with the same samples."""
    import pickle

    from petatrain.data.loading import stream

    made, real = [], stream._ShardReader

    def counted(dataset):
        reader = real(dataset)
        if dataset is ds:
            made.append(reader)
        return reader

    monkeypatch.setattr(stream, "_ShardReader", counted)

    def fresh(epoch, state=None):
        ref = StreamingDataset(token_ds, batch_size=BATCH, seed=4, prefetch=False)
        ref.set_epoch(epoch)
        if state:
            ref.load_state_dict(state)
        return [int(i) for batch in ref.iter_batches() for i in batch["index"]]

    ds = StreamingDataset(token_ds, batch_size=BATCH, seed=4)

    def run(dataset=ds):
        return [int(i) for batch in dataset.iter_batches() for i in batch["index"]]

    assert run() == fresh(0)
    handoff = ds._handoff
    assert handoff is not None and handoff.key[1] == 1 and (handoff.reader.pending or handoff.reader.shards)
    assert len(made) == 2  # epoch 0's reader and epoch 1's, started during epoch 0
    ds.set_epoch(1)
    assert run() == fresh(1)
    assert len(made) == 3  # epoch 1 read with the reader started for it, and started epoch 2's
    assert run() == fresh(1)  # epoch 1 again: epoch 2's reader is not for it
    assert not ds._handoff.reader.pending or all(f.done() for f in ds._handoff.reader.pending.values())
    copy = pickle.loads(pickle.dumps(ds))  # a reader with threads and loaded shards stays behind
    assert copy._handoff is None and run(copy) == fresh(1)
    ds.set_epoch(2)
    state = {**ds.state_dict(consumed=3 * BATCH)}
    ds.load_state_dict(state)
    assert run() == fresh(2, state)  # resumed mid-epoch: not what epoch 2's reader was started for


@pytest.mark.skipif(not hasattr(os, "getpriority") or os.uname().sysname != "Linux", reason="per-thread nice")
def test_prefetch_threads_run_below_the_loop(token_ds):
    import threading
    import time

    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ds = StreamingDataset(token_ds, batch_size=BATCH)
    batches = ds.iter_batches()
    next(batches)
    deadline, nices = time.time() + 5, []
    while time.time() < deadline:
        threads = [t for t in threading.enumerate() if t.name.startswith("petatrain-prefetch") and t.native_id]
        nices = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads]
        if nices and all(n == min(19, loop + 10) for n in nices):
            break
        time.sleep(0.02)
    batches.close()
    assert nices and all(n == min(19, loop + 10) for n in nices), nices


def test_opening_a_dataset_does_not_import_pandas(token_ds):
    """pandas' import is ~0.3 s of a loader's start; pyarrow pulls it in through
    ChunkedArray.to_numpy and pyarrow.dataset, which the loader's path must not touch."""
    import subprocess
    import sys

    code = (
        "import sys; from petatrain.data import StreamingDataset; "
        f"ds = StreamingDataset({token_ds!r}, batch_size=4); next(iter(ds.iter_batches())); "
        "print('pandas' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
