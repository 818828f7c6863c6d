"""Continuous training's data side, as pure functions: the held-out rows stable across versions, and
the pass that carries a run's position from version v onto w (every new row once, a replay share
of v's rows continuing the run's own sequence)."""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from petatrain.data.loading.continuation import ContinuedOrder, Switch, replayed
from petatrain.data.loading.heldout import HeldOut
from petatrain.data.loading.order import SampleOrder


def _shards(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 400, count)


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.5])
def test_the_held_out_rows_are_every_nth_row_and_stay_held_out_in_later_versions(fraction):
    rows = _shards(40, seed=1)
    split = HeldOut(rows, fraction)
    held, train = split.eval_counts(), split.train_counts()
    for s, n in enumerate(rows):
        eval_rows = split.eval_row(np.full(held[s], s), np.arange(held[s])).tolist()
        train_rows = split.train_row(np.full(train[s], s), np.arange(train[s])).tolist()
        assert sorted(eval_rows + train_rows) == list(range(n)), s  # each row on one side, once
        assert train_rows == sorted(train_rows) and eval_rows == sorted(eval_rows)
        if fraction:
            assert abs(held[s] - n * fraction) <= 1
    assert int(held.sum()) == 0 if not fraction else abs(int(held.sum()) - rows.sum() * fraction) <= len(rows)
    # An append adds shards; the old shards' held-out rows are the same, the new ones get their own.
    more_rows = _shards(60, seed=2)
    grown = HeldOut(np.concatenate([rows, more_rows[40:]]), fraction)
    assert grown.eval_counts()[:40].tolist() == held.tolist()
    assert grown.first[:40].tolist() == split.first.tolist()
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 0.5\]"):
        HeldOut(rows, 0.7)
    # A slice of the shards (numbered from first_shard) splits as the whole does.
    part = HeldOut(rows[10:20], fraction, first_shard=10)
    assert part.eval_counts().tolist() == held[10:20].tolist()


def _pass(old_rows, new_rows, switch, **kw) -> ContinuedOrder:
    return ContinuedOrder(old_rows, new_rows, switch=switch, to_version=2, seed=7, shuffle=True, window=64, **kw)


@pytest.mark.parametrize("replay", [0.0, 0.05, 0.25])
def test_the_continuation_pass_reads_every_new_row_once_and_replays_the_runs_own_sequence(replay):
    old_rows, new_rows = np.array([100, 80, 120, 90]), np.array([70, 50, 60])
    switch = Switch(from_version=1, old_shards=4, epoch=3, position=360, replay=replay, window=48)  # 30 left in epoch 3
    order = _pass(old_rows, new_rows, switch)
    assert order.num_samples == 180 + replayed(180, 390, replay)
    shards, rows = order.locate(np.arange(order.num_samples))
    fresh = shards >= 4
    assert sorted(zip(shards[fresh].tolist(), rows[fresh].tolist(), strict=True)) == [
        (4 + s, r) for s, n in enumerate(new_rows) for r in range(n)
    ]  # every new row exactly once
    # The replays are v's sequence from where the run was: the rest of epoch 3, then epoch 4.
    wanted = order.replay_count
    old3, old4 = (SampleOrder(old_rows, seed=7, epoch=e, shuffle=True, window=48) for e in (3, 4))
    left = min(wanted, 390 - 360)
    expect = list(zip(*old3.locate(np.arange(360, 360 + left)), strict=True))
    expect += list(zip(*old4.locate(np.arange(wanted - left)), strict=True))
    got = list(zip(shards[~fresh].tolist(), rows[~fresh].tolist(), strict=True))
    assert got == [(int(s), int(r)) for s, r in expect]
    # Every batch holds its replay share, to within one row.
    batch = 16
    per_batch = [int((~fresh[i : i + batch]).sum()) for i in range(0, order.num_samples - batch + 1, batch)]
    share = wanted / order.num_samples * batch
    assert all(abs(n - share) <= 1 for n in per_batch), (per_batch, share)


def test_the_pass_is_dealt_out_the_same_at_any_world_size_and_resumes_anywhere():
    order = _pass(np.array([50, 60]), np.array([40, 45]), Switch(1, 2, epoch=0, position=20, replay=0.2, window=30))
    whole = order.locate(np.arange(order.num_samples))
    for world in (1, 2, 3):
        for start in (0, 17, order.num_samples - 5):
            seen: dict[int, tuple[int, int]] = {}
            for rank in range(world):
                d = order.deal(start, rank, world, drop_last=False)
                positions = d.positions(0, d.count)
                for p, s, r in zip(positions.tolist(), *order.locate(positions), strict=True):
                    seen[p] = (int(s), int(r))
            assert sorted(seen) == list(range(start, order.num_samples))
            assert all(seen[p] == (int(whole[0][p]), int(whole[1][p])) for p in seen)


def test_a_switch_is_read_back_from_a_loader_state_and_a_bad_one_is_refused():
    switch = Switch(1, 4, epoch=3, position=360, replay=0.05, window=48)
    assert Switch.from_json(switch.to_json()) == switch
    for bad in ({**switch.to_json(), "position": -1}, {**switch.to_json(), "replay": 1.0}, {"epoch": 1}, [1]):
        with pytest.raises(ValueError, match="continuation"):
            Switch.from_json(bad)


def test_window_shards_are_what_the_window_reads():
    order = _pass(np.array([300, 200]), np.array([250]), Switch(1, 2, epoch=1, position=100, replay=0.1, window=64))
    for w in range(-(-order.num_samples // order.window)):
        positions = np.arange(w * order.window, min((w + 1) * order.window, order.num_samples))
        assert set(order.window_shards(w)) == set(order.locate(positions)[0].tolist())


# -- the loader over a dataset that grew: v1 ingested, v2 appended -----------------------------

BATCH = 8


@pytest.fixture(scope="module")
def grown(tmp_path_factory, ray_local):
    """A token dataset of two versions: v1 (~12 shards), then an append of about half as much (v2)."""
    from helpers import ingest
    from petatrain.data import synth

    root = tmp_path_factory.mktemp("grown")
    settings = dict(dedup="exact", tokenizer="bytes", pack_length=65, shard_size="20KB")
    first = synth.generate(str(root / "a"), documents=500, files=2, mean_words=60, bad_records=False, seed=3)
    ingest(first.files, root / "ds", **settings)
    second = synth.generate(str(root / "b"), documents=250, files=1, mean_words=60, bad_records=False, seed=4)
    ingest([*first.files, *second.files], root / "ds", append=True, **settings)
    return str(root / "ds")


def test_each_commit_is_a_dataset_committed_event_that_a_poller_reads_from_an_offset(grown, tmp_path):
    """The commit log (data/commit_log.py): an event per version, what it added and its record's
    SHA-256; read after a version; an event lost after its commit is read from the version's record;
    gc removes version records, never events; `petatrain dataset events` shows and emits them."""
    import hashlib
    import json

    from typer.testing import CliRunner

    from petatrain import api
    from petatrain.cli import app
    from petatrain.data import commit_log
    from petatrain.data.index import version_path

    ds = tmp_path / "ds"
    shutil.copytree(grown, ds)  # gc below must not touch the module's dataset
    events = commit_log.read(str(ds))
    assert [(e["event"], e["version"], e.get("derived")) for e in events] == [
        ("dataset.committed", 1, None),
        ("dataset.committed", 2, None),
    ]
    v1, v2 = events
    assert v1["rows_added"] == v1["rows"] > 0 and v2["rows_added"] == v2["rows"] - v1["rows"] > 0
    assert v2["tokens_added"] == v2["tokens"] - v1["tokens"] > 0 and v2["shards_added"] > 0
    for e in events:
        assert e["manifest_sha256"] == hashlib.sha256((ds / version_path(e["version"])).read_bytes()).hexdigest()
    assert commit_log.read(str(ds), after=1) == [v2] and commit_log.read(str(ds), after=2) == []
    (ds / commit_log.event_path(2)).unlink()  # written after the commit: a write that failed
    assert commit_log.read(str(ds), after=1) == [{**v2, "derived": True}]
    (ds / commit_log.event_path(1)).write_text("{not json")  # damaged: the record says the same
    assert commit_log.read(str(ds)) == [{**v1, "derived": True}, {**v2, "derived": True}]
    commit_log.record(str(ds), v1)
    (tmp_path / "runs").mkdir()
    done = api.dataset_gc(str(ds), keep=1, runs=[str(tmp_path / "runs")], registry=str(tmp_path / "registry"))
    assert done["removed"] == [1] and not (ds / version_path(1)).exists()
    # v1's event outlives its record, and says what v2 added
    after_gc = {**v2, "derived": True, "duplicates_dropped": None, "rejected": None}
    assert commit_log.read(str(ds)) == [v1, after_gc]
    runner = CliRunner()
    shown = runner.invoke(app, ["dataset", "events", str(ds), "--after", "1", "--json"], catch_exceptions=False)
    assert shown.exit_code == 0 and json.loads(shown.stdout)["events"] == [after_gc]
    text = runner.invoke(app, ["dataset", "events", str(ds)], catch_exceptions=False).stdout
    assert f"v2  {v2['committed']}  rows {v2['rows']:,} (+{v2['rows_added']:,})" in text and "v1" in text
    bad = runner.invoke(app, ["dataset", "events", str(ds), "--after", "-1"])
    assert bad.exit_code == 2 and "--after must be a version number >= 0" in bad.stderr
    missing = runner.invoke(app, ["dataset", "events", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nothing'} is not a committed dataset (no {tmp_path / 'nothing'}/_index/manifest.json)"
    ]


def _loaders(url, world, **kw):
    from petatrain.data import StreamingDataset

    return [
        StreamingDataset(url, rank=r, world_size=world, batch_size=BATCH, seed=7, held_out=0.1, **kw)
        for r in range(world)
    ]


def _lockstep(loaders, state=None, steps=None, carry=None):
    """Run ranks in lockstep from `state` (carried onto their version with replay `carry`); the
    indices each step read (all ranks), and the state after them."""
    import json

    for d in loaders:
        if state is not None:
            d.load_state_dict(json.loads(json.dumps(d.carried_over(state, carry) if carry is not None else state)))
    iters, read = [d.iter_batches() for d in loaders], []
    while steps is None or len(read) < steps:
        got = [next(it, None) for it in iters]
        if all(g is None for g in got):
            break
        read.append([int(i) for g in got if g is not None for i in g["index"]])
    return read, loaders[0].state_dict(consumed=len(read) * BATCH)


def test_held_out_rows_stay_held_out_when_the_dataset_grows(grown):
    from petatrain.data import StreamingDataset

    def indices(url, split):
        return {int(i) for b in StreamingDataset(url, held_out=0.1, split=split, shuffle=False).iter_batches()
                for i in b["index"]}  # fmt: skip

    old_eval, new_eval, new_train = indices(f"{grown}@v1", "eval"), indices(grown, "eval"), indices(grown, "train")
    v1_rows, v2_rows = (StreamingDataset(u).num_samples for u in (f"{grown}@v1", grown))
    assert old_eval < new_eval and not new_eval & new_train and new_eval | new_train == set(range(v2_rows))
    added = new_eval - old_eval
    assert added and min(added) >= v1_rows  # the append's own held-out rows
    assert abs(len(new_eval) - 0.1 * v2_rows) <= StreamingDataset(grown).manifest.totals.shards


def test_a_position_in_v1_is_carried_onto_v2_every_new_row_once_with_replay_at_any_world_size(grown):
    """A run over v1 at 2 ranks stops a third of the way through its epoch; carried onto v2 at 3
    ranks, the pass reads every training row v2 added once, and a 25% share of v1's rows that
    continues the run's own order (none it read in this epoch); resumed in the middle of the pass
    at 1 rank, the pass reads the same rows."""
    from petatrain.data import StreamingDataset

    replay = 0.25
    v1 = StreamingDataset(f"{grown}@v1", held_out=0.1)
    before, state = _lockstep(_loaders(f"{grown}@v1", 2), steps=v1.num_samples // (3 * 2 * BATCH))
    read_before = {i for step in before for i in step}
    whole, _ = _lockstep(_loaders(grown, 3), state, carry=replay)
    passed = [i for step in whole for i in step]
    v1_rows = StreamingDataset(f"{grown}@v1").num_samples
    new_train = sorted(
        int(i) for b in StreamingDataset(grown, held_out=0.1, shuffle=False).iter_batches() for i in b["index"]
    )
    fresh, replays = [i for i in passed if i >= v1_rows], [i for i in passed if i < v1_rows]
    assert sorted(fresh) == [i for i in new_train if i >= v1_rows]  # every new training row, once
    assert len(replays) == replayed(len(fresh), v1.num_samples, replay) and len(set(replays)) == len(replays)
    assert not set(replays) & read_before  # the rest of the run's epoch over v1, nothing read again
    eval_rows = {int(i) for b in StreamingDataset(grown, held_out=0.1, split="eval").iter_batches() for i in b["index"]}
    assert not set(passed) & eval_rows
    for step in whole[:-1]:  # every step holds its share of replays, to within a row or two
        assert abs(sum(i < v1_rows for i in step) - replay * len(step)) <= 2, step

    head, mid = _lockstep(_loaders(grown, 3), state, steps=5, carry=replay)
    assert mid["continuation"]["from_version"] == 1 and len(str(mid)) < 600  # four numbers, no row list
    tail, _ = _lockstep(_loaders(grown, 1), mid)  # a resize in the middle of the pass
    assert sorted(i for step in head + tail for i in step) == sorted(passed)


def test_a_position_that_cannot_be_carried_is_refused_in_one_line(grown):
    from petatrain.data import StreamingDataset
    from petatrain.errors import PetatrainError

    _, state = _lockstep(_loaders(f"{grown}@v1", 1), steps=3)
    (later,) = _loaders(grown, 1)
    with pytest.raises(PetatrainError, match=r"holds out 0\.1 rows per shard, this loader none"):
        StreamingDataset(grown, batch_size=BATCH, seed=7).carried_over(state, 0.05)
    (v1,) = _loaders(f"{grown}@v1", 1)
    _, carried = _lockstep(_loaders(grown, 1), state, steps=2, carry=0.05)
    with pytest.raises(PetatrainError, match=r"version 2 .* is version 1: a run continues onto the same or a later"):
        v1.carried_over(carried, 0.05)
    assert later.carried_over(carried, 0.05) == carried  # the same version: nothing to carry


# -- train --continue ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.chaos
def test_train_continue_goes_on_with_the_next_version_and_kills_in_it_change_nothing(grown, tmp_path):
    """A run trained on v1 is continued onto v2: a new run from its checkpoint, its data position
    carried over (the new rows once, 25% replay), its schedule warmed up again. Killed before its
    first checkpoint of its own (the recovery carries the position over again) and after it, it
    ends with the weights of the uninterrupted continuation. What cannot be continued is one line."""
    from helpers import read_events, sha256, tiny
    from petatrain import api
    from petatrain.errors import ConfigError, PetatrainError

    base = ("parallel.workers=2", "checkpoint.every=5", "train.eval_every=0", "train.warmup_steps=3")
    first = tmp_path / "first"
    assert api.train(tiny(f"{grown}@v1", *base, "train.steps=10"), run_dir=str(first)).steps == 10
    later = tiny(grown, *base, "train.steps=25", "data.replay=0.25")

    whole = api.train(later, carry=str(first))  # no --run-dir: idempotent, beside the run it continues
    assert Path(whole.run).parent == tmp_path and Path(whole.run).name.startswith("first+v2-")
    ledger = read_events(whole.run)
    again = api.train(later, carry=str(first))  # a retry of a finished continuation: its result, no work
    assert (again.run, again.steps, again.attempts) == (whole.run, 25, 1) and read_events(whole.run) == ledger
    killed = api.train(
        later,
        run_dir=str(tmp_path / "killed"),
        carry=str(first),
        injections=["kill@step=13,rank=1", "kill@step=18,rank=0"],
    )
    assert whole.steps == killed.steps == 25 and killed.attempts == 3
    assert sha256(Path(whole.run) / "final" / "model.safetensors") == sha256(
        tmp_path / "killed" / "final" / "model.safetensors"
    )
    killed_ledger = read_events(str(tmp_path / "killed"))  # its retry with --resume: not started again
    retried = api.train(later, run_dir=str(tmp_path / "killed"), carry=str(first), resume=True)
    assert retried.attempts == 3 and read_events(str(tmp_path / "killed")) == killed_ledger
    events = read_events(whole.run)
    start = events[0]
    carried = {"from_version": 1, "to_version": 2, "new_rows": mock.ANY, "replay_rows": mock.ANY}
    assert start["source"] == {"from": f"{first}@10", "step": 10, "carry": carried}
    pass_ = start["source"]["carry"]
    assert pass_["new_rows"] > 0 and pass_["replay_rows"] == replayed(pass_["new_rows"], 1, 0.25)
    assert start["config"]["data"]["dataset"] == f"{grown}@v2" and start["config"]["train"]["schedule_start"] == 10
    lr = {e["step"]: e["lr"] for e in events if e["event"] == "step" and e.get("rank", 0) == 0}
    assert min(lr) == 11 and lr[11] < lr[13] and lr[13] == pytest.approx(0.003) and lr[25] < lr[14]  # re-warmed
    resumes = [e["step"] for e in read_events(str(tmp_path / "killed")) if e["event"] == "resume"]
    assert resumes == [10, 10, 15]

    # The lineage: the continuation, then the run it came from, each with what it read.
    newest, oldest = api.lineage(str(tmp_path / "killed"))
    assert (newest["how"], newest["source"], newest["start_step"], newest["step"]) == (
        "continue",
        f"{first}@10",
        10,
        25,
    )
    replays = 15 * 16 * pass_["replay_rows"] // (pass_["new_rows"] + pass_["replay_rows"])
    assert [(r["version"], r["kind"], r["rows"]) for r in newest["reads"]] == [
        (2, "new", 240 - replays),
        (1, "replay", replays),
    ]
    assert (oldest["run"], oldest["how"], oldest["reads"]) == (str(first), "start", [
        {"dataset": grown, "version": 1, "kind": "epochs", "rows": 160}])  # fmt: skip
    assert api.report(str(tmp_path / "killed")).to_dict()["trained_on"] == newest["reads"]

    # The gate and the registry: the first run is version 1; the continuation is compared with it
    # on the same held-out rows (v2's: those of the new shards, and those of v1's) and promoted.
    reg, whole_run = str(tmp_path / "registry"), whole.run
    first_version = api.promote(str(first), "tiny", registry=reg)
    assert first_version["version"] == 1 and first_version["eval"]["verdict"]["passed"]
    picky = tiny(grown, "promote.min_improvement=0.9")
    with pytest.raises(PetatrainError, match="does not pass the gate against registry://tiny@champion: newest data"):
        api.promote(whole_run, "tiny", config=picky, registry=reg)
    gate = api.evaluate(whole_run, against="registry://tiny@champion", registry=reg)
    losses = gate["losses"]
    assert all(losses[who][split]["rows"] > 0 for who in ("candidate", "against") for split in ("newest", "earlier"))
    assert losses["candidate"]["newest"]["loss"] < losses["against"]["newest"]["loss"]  # it learnt the new data
    second = api.promote(whole_run, "tiny", registry=reg, force=True)
    assert second["version"] == 2 and second["dataset"] == f"{grown}@v2" and second["lineage"][1]["run"] == str(first)
    assert [link["promotions"] for link in api.lineage(whole_run, registry=reg)] == [["tiny@v2"], ["tiny@v1"]]

    def refused(match, *overrides, spec=str(first), dataset=grown):
        with pytest.raises(ConfigError, match=match):
            api.train(tiny(dataset, *base, "train.steps=25", *overrides), run_dir=str(tmp_path / "no"), carry=spec)
        assert not (tmp_path / "no").exists(), "a refused run leaves no folder behind"

    refused(r"model\.d_model is 64 there, 128 here", "model.d_model=128")
    refused(r"data\.eval_split rows 0\.01, this run shards", "data.eval_split=shards")
    refused(r"train\.steps 8 is not past step 10", "train.steps=8")
    refused(r"no committed checkpoint of step 7", spec=f"{first}@7")
    shutil.copytree(grown, tmp_path / "copy")  # the same rows, but another dataset
    refused(
        r"it trained on .*grown.*, data\.dataset is .*copy; a continuation goes on with later versions",
        dataset=str(tmp_path / "copy"),
    )


def test_inspect_lists_the_versions_and_a_missing_one_is_one_line_naming_those_there(grown):
    from petatrain import api
    from petatrain.data import index
    from petatrain.errors import PetatrainError

    report = api.inspect(grown, samples=0).fields
    v1, v2 = report["versions"]
    assert (v1["version"], v2["version"]) == (1, 2) and v1["rows_added"] + v2["rows_added"] == report["rows"] == v2[
        "rows"
    ]
    assert v2["sources_added"] == 1 and v1["sources"] == 2 and v2["tokens"] > v1["tokens"] > 0
    with pytest.raises(PetatrainError, match=r"has no version 99: its versions are v1-v2$"):
        index.open_dataset(f"{grown}@v99")


def test_dataset_gc_removes_old_versions_but_those_a_run_or_a_registered_model_names(grown, tmp_path):
    from petatrain import api
    from petatrain.data import index
    from petatrain.data.loading.stream import StreamingDataset
    from petatrain.errors import PetatrainError
    from petatrain.registry.store import Registry

    ds = tmp_path / "ds"
    shutil.copytree(grown, ds)
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "config.yaml").write_text(f"data:\n  dataset: {ds}@v1\n")
    reg = str(tmp_path / "registry")
    Registry(reg).register("tiny", {"run": "/r", "checkpoint": "final", "checksum": "x", "dataset": f"{ds}@v1"})
    kept = api.dataset_gc(str(ds), keep=1, runs=[str(runs)], registry=reg)
    assert kept["removed"] == [] and kept["in_use"] == {"1": [f"run {runs / 'a'}", "registry://tiny@1"]}
    assert StreamingDataset(f"{ds}@v1").num_samples > 0

    (runs / "a" / "config.yaml").write_text(f"data:\n  dataset: {ds}@v2\n")
    shutil.rmtree(reg)
    done = api.dataset_gc(str(ds), keep=1, runs=[str(runs)], registry=reg)
    assert (done["removed"], done["kept"]) == ([1], [2])
    with pytest.raises(PetatrainError, match=r"@v1 is not kept .* its versions are v2"):
        index.open_dataset(f"{ds}@v1")
    assert StreamingDataset(str(ds)).num_samples == StreamingDataset(grown).num_samples  # every shard still there
    assert len(list((ds / "_index").glob("shards-*.parquet"))) == 1


def test_a_dataset_too_small_to_hold_out_rows_says_so_at_the_start(grown, caplog):
    from helpers import tiny
    from petatrain.runtime import preflight

    with caplog.at_level("WARNING", logger="petatrain.runtime.preflight"):
        preflight.says_if_nothing_is_held_out(tiny(grown, "data.eval_split=shards", "data.eval_shards=40"), None)
    assert "not more than data.eval_shards 40: nothing is held out and the run is not evaluated" in caplog.text
