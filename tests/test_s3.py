"""The same ingest against a real S3-compatible server (Ceph RGW started by the test setup)."""

import gzip
import json

import pytest

from conftest import run_cli
from helpers import ingest, read_dataset
from petatrain import storage
from petatrain.data import index, lineage

pytestmark = pytest.mark.s3


@pytest.fixture
def s3_corpus(s3_bucket, corpus):
    """The shared corpus uploaded under s3://bucket/raw/."""
    for path in corpus.files:
        with open(path, "rb") as handle:
            storage.atomic_write(storage.join(s3_bucket, "raw", path.rsplit("/", 1)[1]), handle.read())
    return storage.join(s3_bucket, "raw")


def test_ingest_s3_to_s3_round_trip(s3_endpoint, s3_corpus, s3_bucket, ray_local, tmp_path):
    out = storage.join(s3_bucket, "datasets", "c4ish")
    summary = ingest([s3_corpus], out, shard_size="400KB")
    assert summary.shards >= 2 and summary.near_duplicates > 0
    remote = read_dataset(out)
    # The same sources read from local disk give the same dataset.
    local = tmp_path / "local"
    local_sources = [f"{tmp_path}/src-{i}.jsonl" for i in range(len(storage.listdir(s3_corpus)))]
    for url, path in zip(storage.listdir(s3_corpus), local_sources, strict=True):
        with open(path, "wb") as handle:
            handle.write(storage.read_bytes(url))
    ingest(local_sources, local, shard_size="400KB")
    assert remote.column("text").to_pylist() == read_dataset(local).column("text").to_pylist()
    # Gzipped, the same files are read as streams of ranged reads, in pieces: the same dataset again.
    for i, path in enumerate(local_sources):
        with open(path, "rb") as handle:
            storage.atomic_write(storage.join(s3_bucket, "gz", f"src-{i}.jsonl.gz"), gzip.compress(handle.read()))
    streamed = storage.join(s3_bucket, "datasets", "c4ish-gz")
    ingest([storage.join(s3_bucket, "gz")], streamed, shard_size="400KB", split_size="64KB")
    assert read_dataset(streamed).column("text").to_pylist() == remote.column("text").to_pylist()
    # No staging is left behind, and the committed files verify.
    assert not [u for u in storage.listdir(out) if "/_staging/" in u]
    assert index.verify_shards(index.open_dataset(out)) == []

    # Re-running is a no-op; inspect --verify through the CLI works against S3 too.
    assert ingest([s3_corpus], out, shard_size="400KB").files_new == 0
    result = run_cli("inspect", out, "--verify", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["rows"] == remote.num_rows


def test_corrupt_shard_on_s3_is_named(s3_endpoint, s3_bucket, ray_local, tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(50)))
    out = storage.join(s3_bucket, "ds")
    ingest([str(tmp_path / "a.jsonl")], out, dedup="exact")
    shard = storage.listdir(storage.join(out, "data"))[0]
    data = bytearray(storage.read_bytes(shard))
    data[100] ^= 0xFF
    storage.atomic_write(shard, bytes(data))
    problems = index.verify_shards(index.open_dataset(out))
    assert problems == [
        f"corrupt: {shard} (checksum {problems[0].split('checksum ')[1].split(' ')[0]} "
        f"!= recorded {index.open_dataset(out).shards.column('checksum')[0].as_py()})"
    ]


def test_missing_bucket_is_a_clear_error(s3_endpoint, tmp_path):
    result = run_cli("ingest", "s3://no-such-bucket-petatrain/x.jsonl", "--out", str(tmp_path / "ds"))
    assert result.returncode == 2
    assert "source not found: s3://no-such-bucket-petatrain/x.jsonl" in result.stderr


@pytest.fixture
def s3_token_ds(s3_bucket, ray_local, tmp_path):
    from petatrain.data import synth

    corpus = synth.generate(str(tmp_path / "raw"), documents=400, files=2, mean_words=60, bad_records=False, seed=4)
    out = storage.join(s3_bucket, "tokens")
    ingest(corpus.files, out, dedup="exact", tokenizer="bytes", pack_length=64, shard_size="20KB")
    return out


def test_stream_from_s3_fetches_each_shard_once_per_node(s3_token_ds, tmp_path, monkeypatch):
    from petatrain.data import StreamingDataset
    from petatrain.data.loading import cache

    fetched = []
    original = cache.ShardCache._fetch

    def counting(self, url, *args):
        fetched.append(url)
        return original(self, url, *args)

    monkeypatch.setattr(cache.ShardCache, "_fetch", counting)
    seen = []
    for rank in range(2):  # two ranks of one node share the cache folder
        ds = StreamingDataset(s3_token_ds, rank=rank, world_size=2, seed=1, cache_dir=str(tmp_path / "cache"))
        seen += [s["index"] for s in ds]
    assert sorted(seen) == list(range(ds.num_samples))
    assert len(fetched) == len(set(fetched)) == len(ds._rows)


def test_stream_cache_limit_is_honoured(s3_token_ds, tmp_path):
    from petatrain.data import StreamingDataset
    from petatrain.errors import PetatrainError

    probe = StreamingDataset(s3_token_ds, cache_dir=str(tmp_path / "probe"))
    limit = int(probe._bytes.max() * 4)
    rows = int(probe._rows.min())
    ds = StreamingDataset(
        s3_token_ds, seed=2, cache_dir=str(tmp_path / "cache"), cache_limit=limit, shuffle_window=rows
    )
    assert sorted(s["index"] for s in ds) == list(range(ds.num_samples))
    cached = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.parquet"))
    assert 0 < cached <= limit
    tiny = StreamingDataset(s3_token_ds, cache_dir=str(tmp_path / "tiny"), cache_limit=100)
    with pytest.raises(PetatrainError, match="cache_limit 100 bytes cannot hold"):
        list(tiny)


@pytest.mark.slow
def test_training_with_data_and_run_on_s3_recovers_from_a_kill(s3_bucket, ray_local, tmp_path):
    """Dataset, checkpoints, ledger and final weights on the object store; a kill resumes from S3."""
    from helpers import tiny
    from petatrain.data import synth
    from petatrain.observe.ledger import read_events
    from petatrain.storage import StorageOptions
    from petatrain.train.checkpoint import committed_steps

    corpus = synth.generate(str(tmp_path / "raw"), documents=300, files=2, bad_records=False, seed=5)
    data = storage.join(s3_bucket, "tokens65")
    ingest(corpus.files, data, dedup="exact", tokenizer="bytes", pack_length=65, shard_size="100KB")
    run_url = storage.join(s3_bucket, "runs", "r1")
    cfg = tiny(data, "train.steps=24")
    from petatrain.chaos.inject import parse
    from petatrain.runtime.driver import TrainJob, run

    # The kill comes after step 21. Step 20's snapshot waited for step 10's write, so step 10 was
    # committed by then. Step 20's write may or may not have finished: a SIGKILL loses a write
    # that is still in flight, and how long it takes to reach the store is up to the machine.
    summary = run(
        TrainJob(config=cfg, run_url=run_url, options=StorageOptions(), injections=[parse("kill@step=21,rank=1")])
    )
    assert [f["cause"] for f in summary["failures"]] == ["kill"]
    events = read_events(run_url)
    resumed = [e["step"] for e in events if e["event"] == "resume"]
    assert resumed in ([0, 10], [0, 20]), resumed
    if resumed[1] == 10:  # then step 20 was not committed: its write was lost with rank 1
        assert 20 not in [e["step"] for e in events if e["event"] == "checkpoint_commit" and e["attempt"] == 0]
    from petatrain.observe.goodput import account

    assert account(events).to_dict()["faults"][0]["steps_lost"] == 21 - resumed[1]
    assert committed_steps(run_url) == [20, 24]  # keep_last: 2
    assert len(storage.read_bytes(summary["final"])) > 0


def test_serve_loads_and_verifies_a_run_on_s3(s3_endpoint, s3_bucket, baseline):
    """A run directory on the object store: serve reads its config, final weights and a checkpoint
    from there, verified; a changed byte in the weights is refused naming the s3:// file."""
    import os

    from petatrain.errors import CorruptDataError
    from petatrain.train import weights

    run = storage.join(s3_bucket, "runs", "tiny")
    for folder, _, files in os.walk(baseline):
        for name in files:
            local = os.path.join(folder, name)
            with open(local, "rb") as handle:
                storage.atomic_write(storage.join(run, os.path.relpath(local, baseline)), handle.read())
    final, step = weights.load(run, "final"), weights.load(run, "20")
    assert (final.source, final.step, step.step) == ("final", 30, 20)
    local = weights.load(str(baseline), "final")
    assert all(final.weights[k].equal(local.weights[k]) for k in local.weights)
    url = storage.join(run, "final", "model.safetensors")
    data = bytearray(storage.read_bytes(url))
    data[-1] ^= 0xFF
    storage.atomic_write(url, bytes(data))
    with pytest.raises(CorruptDataError, match=f"{url} does not verify"):
        weights.load(run, "final")


def test_a_large_file_on_s3_is_split_into_ranged_reads_and_ingests_as_unsplit(
    s3_endpoint, s3_bucket, ray_local, tmp_path
):
    lines = [json.dumps({"text": f"document {i} " + "word " * (i % 40)}) for i in range(600)]
    lines[123] = '{"text": "broken'
    data = ("\n".join(lines) + "\n").encode()
    url = storage.join(s3_bucket, "raw", "big.jsonl")
    storage.atomic_write(url, data)
    (tmp_path / "big.jsonl").write_bytes(data)
    remote = ingest([url], tmp_path / "from-s3", split_size=str(len(data) // 4 + 1), dedup="exact")
    local = ingest([str(tmp_path / "big.jsonl")], tmp_path / "local", split_size="0", dedup="exact")
    assert (remote.files_split, remote.pieces, local.pieces) == (1, 4, 1)
    assert read_dataset(tmp_path / "from-s3").to_pylist() == read_dataset(tmp_path / "local").to_pylist()
    assert remote.rejected == local.rejected == {"malformed_json": 1}
    source, unsplit = (
        lineage.read_sources(str(out), index.read_manifest(str(out))).to_pylist()[0]
        for out in (tmp_path / "from-s3", tmp_path / "local")
    )
    assert (source["url"], source["checksum"]) == (url, unsplit["checksum"])


def test_versions_the_carry_over_gc_and_the_registry_on_s3(s3_endpoint, s3_bucket, ray_local, tmp_path):
    """Continuous training's storage side on S3: an append is version 2 and v1 still opens; a position
    in v1 is carried onto v2 (each new row once); gc removes v1 once nothing names it; the registry
    writes, moves and rolls back its alias there, and a tampered record is refused naming it."""
    from petatrain import api
    from petatrain.data import StreamingDataset, synth
    from petatrain.errors import CorruptDataError, PetatrainError
    from petatrain.registry.store import Registry, parse_ref

    settings = dict(dedup="exact", tokenizer="bytes", pack_length=65, shard_size="20KB")
    a = synth.generate(str(tmp_path / "a"), documents=200, files=1, mean_words=60, bad_records=False, seed=3)
    b = synth.generate(str(tmp_path / "b"), documents=100, files=1, mean_words=60, bad_records=False, seed=4)
    ds = storage.join(s3_bucket, "datasets", "grows")
    ingest(a.files, ds, **settings)
    ingest([*a.files, *b.files], ds, append=True, **settings)
    old, new = (
        StreamingDataset(f"{ds}@v1", held_out=0.1, batch_size=8),
        StreamingDataset(ds, held_out=0.1, batch_size=8),
    )
    state = old.state_dict(consumed=16)
    new.load_state_dict(new.carried_over(state, 0.0))
    n1 = StreamingDataset(f"{ds}@v1").num_samples
    read = [int(i) for batch in new.iter_batches() for i in batch["index"]]
    assert read and min(read) >= n1 and len(set(read)) == len(read) == new.num_samples - old.num_samples

    assert api.dataset_gc(ds, keep=1, runs=[str(tmp_path / "no-runs")], registry=str(tmp_path / "no-reg"))[
        "removed"
    ] == [1]
    with pytest.raises(PetatrainError, match="its versions are v2"):
        index.open_dataset(f"{ds}@v1")

    reg = Registry(storage.join(s3_bucket, "registry"))
    for step in (10, 20):
        fields = {"run": f"{s3_bucket}/runs/a", "checkpoint": "final", "step": step, "checksum": f"x{step}"}
        reg.register("tiny", fields)  # two weights (the same weights again are the same version)
    assert reg.resolve(parse_ref("registry://tiny@champion"))["step"] == 20
    assert reg.rollback("tiny")["version"] == 1
    record = storage.join(s3_bucket, "registry", "tiny", "versions", "v00000001.json")
    storage.atomic_write(record, storage.read_bytes(record).replace(b'"step": 10', b'"step": 11'))
    with pytest.raises(CorruptDataError, match=r"v00000001\.json: its digest does not match"):
        reg.resolve(parse_ref("registry://tiny@champion"))
