"""Continuous training's data side, as pure functions: the held-out rows stable across versions, and
the pass that carries a run's position from version v onto w (every new row once, a replay share
of v's rows continuing the run's own sequence)."""

from __future__ import annotations

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
