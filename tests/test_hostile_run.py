"""A run directory that someone or something else touched: its records are checked, never trusted.

A state.json edited by hand, by a bug or by an attacker (with COMMITTED's checksum recomputed
to match) must make resume fall back to the previous checkpoint, never crash every attempt
or silently start over. `train --run-dir` into a folder that is not a petatrain run must not
write or delete anything in it, and retention deletes only what petatrain wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from petatrain import config
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.storage.checksum import checksum_bytes
from petatrain.train.checkpoint import (
    COMMITTED,
    STATE,
    CheckpointWriter,
    Snapshot,
    latest_verified,
    read_state,
    step_dir,
)

ROOT = Path(__file__).resolve().parent.parent


def _meta(step: int, world: int, strategy: str) -> dict:
    """What the training loop puts in every checkpoint besides the files."""
    loader = {
        "version": 1,
        "epoch": 0,
        "position": 8 * step,
        "seed": 0,
        "shuffle": True,
        "shuffle_window": 64,
        "num_samples": 1000,
        "world_size": world,
        "batch_size": 8,
    }
    groups = [{"lr": 0.001, "betas": [0.9, 0.999], "weight_decay": 0.1, "params": ["w"]}]
    return {"loader": loader, "strategy": strategy, "config_digest": "0123abcd", "param_groups": groups}


def _checkpoint(run: str, step: int, *, world: int = 1, strategy: str = "ddp", keep_last: int = 10) -> None:
    """A checkpoint as the training loop writes it: every rank's file, then rank 0's commit."""
    parts: dict[int, dict] = {}
    for rank in reversed(range(world)):  # rank 0 last: it commits once the others' parts are in
        writer = CheckpointWriter(
            run,
            None,
            report_part=lambda s, r, f: parts.__setitem__(r, f),
            wait_parts=lambda s, w, t: {n: i for f in parts.values() for n, i in f.items()},
            on_commit=lambda info: None,
            keep_last=keep_last,
        )
        tensors = {"rng/cpu": torch.get_rng_state()}
        if rank == 0 or strategy == "fsdp":
            tensors["model/w"] = torch.full((4, 4), float(step))
        meta = _meta(step, world, strategy)
        writer.submit(Snapshot(step=step, rank=rank, world_size=world, tensors=tensors, meta=meta))
        writer.close()
        assert writer.error is None


def _rewrite(run: str, step: int, raw: bytes) -> None:
    """Replace state.json and recompute the checksum COMMITTED holds, as a careful forger would."""
    folder = Path(step_dir(run, step))
    (folder / STATE).write_bytes(raw)
    (folder / COMMITTED).write_text(json.dumps({"state_checksum": checksum_bytes(raw)}))


def _edit(run: str, step: int, change) -> None:
    folder = Path(step_dir(run, step))
    state = json.loads((folder / STATE).read_text())
    _rewrite(run, step, json.dumps(change(state)).encode())


def _set(key: str, value):
    def change(state: dict) -> dict:
        state[key] = value
        return state

    return change


def _drop(key: str):
    def change(state: dict) -> dict:
        del state[key]
        return state

    return change


def _file(name: str, **record):
    def change(state: dict) -> dict:
        state["files"][name] = {**state["files"][name], **record}
        return state

    return change


def _loader(**fields):
    def change(state: dict) -> dict:
        state["loader"] = {**state["loader"], **fields}
        return state

    return change


def _without_file(name: str):
    def change(state: dict) -> dict:
        del state["files"][name]
        return state

    return change


def _borrowed_file(state: dict) -> dict:
    """Names the previous checkpoint's rank file (present, with its true size) instead of its own."""
    info = state["files"].pop("rank-00000.safetensors")
    state["files"]["../step-00000010/rank-00000.safetensors"] = info
    return state


def _extra_rank_file(state: dict) -> dict:
    state["files"]["rank-00001.safetensors"] = dict(state["files"]["rank-00000.safetensors"])
    return state


RANK0 = "rank-00000.safetensors"

HOSTILE_EDITS = {
    "negative step": _set("step", -5),
    "another folder's step": _set("step", 10),
    "a later step": _set("step", 30),
    "step as text": _set("step", "20"),
    "step as a float": _set("step", 20.0),
    "step missing": _drop("step"),
    "format from the future": _set("format", 99),
    "format missing": _drop("format"),
    "world size 0": _set("world_size", 0),
    "world size negative": _set("world_size", -2),
    "world size as text": _set("world_size", "1"),
    "world size missing": _drop("world_size"),
    "files missing": _drop("files"),
    "files not an object": _set("files", [RANK0]),
    "rank 0's file left out": _without_file(RANK0),
    "a rank file beyond the world size": _extra_rank_file,
    "a file outside the folder": _borrowed_file,
    "file size missing": _file(RANK0, bytes=None),
    "file size as text": _file(RANK0, bytes="4096"),
    "file size negative": _file(RANK0, bytes=-1),
    "checksum not a string": _file(RANK0, checksum=12),
    "checksum of another algorithm": _file(RANK0, checksum="md5:00"),
    "file record not an object": _set("files", {RANK0: 12}),
    "loader not an object": _set("loader", "position=8"),
    "loader position negative": _loader(position=-8),
    "loader position beyond the epoch": _loader(position=10**6),
    "loader epoch as text": _loader(epoch="0"),
    "loader world size 0": _loader(world_size=0),
    "strategy not a string": _set("strategy", 1),
    "strategy train does not run": _set("strategy", "zero1"),
    "strategy missing": _drop("strategy"),
    "loader missing": _drop("loader"),
    "param groups missing": _drop("param_groups"),
    "time missing": _drop("time"),
    "param groups not a list": _set("param_groups", {"lr": 0.1}),
    "param group not an object": _set("param_groups", [0.1]),
    "param group params not names": _set("param_groups", [{"lr": 0.1, "params": [0]}]),
}


@pytest.mark.parametrize("edit", HOSTILE_EDITS.values(), ids=HOSTILE_EDITS.keys())
def test_a_forged_state_json_is_skipped_for_the_previous_checkpoint(tmp_path, edit):
    """Every field resume relies on is checked before a checkpoint is chosen: a bad one skips it
    (with the reason, for the `checkpoint_skipped` event), and never raises anything else."""
    run = str(tmp_path)
    _checkpoint(run, 10)
    _checkpoint(run, 20)
    _edit(run, 20, edit)
    skipped: list[tuple[str, str]] = []
    state = latest_verified(run, on_skip=lambda url, why: skipped.append((url, why)))
    assert state is not None and state.step == 10, "the previous checkpoint, not a fresh start"
    assert [url for url, _ in skipped] == [step_dir(run, 20)]
    assert "step-00000020 does not verify" in skipped[0][1]
    with contextlib.suppress(CorruptDataError):  # the other ranks read state.json too: never a crash
        read_state(run, 20)


UNREADABLE = {
    "not JSON": b"\x00\x01 not json",
    "a list": b"[]",
    "a string": b'"step-00000020"',
    "null": b"null",
    "an empty object": b"{}",
}


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_a_state_json_that_is_not_a_record_is_skipped(tmp_path, raw):
    run = str(tmp_path)
    _checkpoint(run, 10)
    _checkpoint(run, 20)
    _rewrite(run, 20, raw)
    skipped: list[str] = []
    assert latest_verified(run, on_skip=lambda url, why: skipped.append(url)).step == 10
    assert skipped == [step_dir(run, 20)]
    with pytest.raises(CorruptDataError, match="step-00000020 does not verify"):
        read_state(run, 20)


@pytest.mark.parametrize("marker", [b"[]", b'"x"', b'{"state_checksum": 5}', b"{", b"{}"])
def test_a_garbled_committed_marker_is_skipped(tmp_path, marker):
    run = str(tmp_path)
    _checkpoint(run, 10)
    _checkpoint(run, 20)
    (Path(step_dir(run, 20)) / COMMITTED).write_bytes(marker)
    assert latest_verified(run).step == 10
    with pytest.raises(CorruptDataError, match="step-00000020 does not verify"):
        read_state(run, 20)


def test_a_forged_record_of_a_missing_rank_file_falls_back(tmp_path):
    """FSDP, 2 ranks: rank 1's file is gone, and state.json no longer names it (or names it
    while it is missing): either way the previous checkpoint is used."""
    run = str(tmp_path)
    _checkpoint(run, 10, world=2, strategy="fsdp")
    _checkpoint(run, 20, world=2, strategy="fsdp")
    assert latest_verified(run).step == 20
    (Path(step_dir(run, 20)) / "rank-00001.safetensors").unlink()
    assert latest_verified(run).step == 10
    _edit(run, 20, _without_file("rank-00001.safetensors"))
    assert latest_verified(run).step == 10
    _edit(run, 20, _set("world_size", 10**9))  # at once: the ranks are not counted one by one
    assert latest_verified(run).step == 10


def test_a_sound_record_is_returned_as_written(tmp_path):
    """The checks refuse nothing the writer writes: DDP and FSDP, one and two ranks."""
    for step, (world, strategy) in enumerate([(1, "ddp"), (2, "ddp"), (2, "fsdp")], start=1):
        run = str(tmp_path / str(step))
        _checkpoint(run, step, world=world, strategy=strategy)
        state = latest_verified(run)
        assert state.step == step and state.world_size == world and state.strategy == strategy
        assert state == read_state(run, step)
        assert sorted(state.files) == [f"rank-{r:05d}.safetensors" for r in range(world)]


# -- the run directory: petatrain writes only into its own runs -------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _users_folder(tmp_path: Path) -> Path:
    """A folder of the user's whose names happen to be those a run has."""
    folder = tmp_path / "thesis"
    for name in ("config.yaml", "report.html", "final/model.safetensors", "checkpoints/step-00000010/COMMITTED"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"the user's {name}")
    return folder


def _dataset(tmp_path: Path) -> Path:
    """Enough of a dataset for train's checks that run before the run directory's."""
    manifest = tmp_path / "dataset" / "_index" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    packed = {"name": "tokens", "type": "fixed_size_binary[130]"}  # rows of 65 byte-tokens, as tiny.yaml reads
    record = {
        "format": "petatrain.dataset", "version": 2, "kind": "packed", "schema": [packed],
        "totals": {"shards": 0, "rows": 0, "bytes": 0}, "lineage": {}, "tokenizer": {"vocab_size": 257},
        "ingest": {"pack_length": 65},
    }  # fmt: skip
    manifest.write_text(json.dumps(record))
    return manifest.parent.parent


def _refusal(folder: Path) -> str:
    return f"--run-dir {folder} is a non-empty folder that is not a petatrain run; choose a new or empty folder"


def test_train_refuses_a_folder_that_is_not_a_run_before_writing_anything(tmp_path):
    from petatrain.runtime.driver import TrainJob, run

    folder = _users_folder(tmp_path)
    before = _tree(folder)
    cfg = config.load(ROOT / "examples" / "tiny.yaml", [f"data.dataset={_dataset(tmp_path)}"])
    with pytest.raises(PetatrainError) as refused:
        run(TrainJob(config=cfg, run_url=str(folder)))
    assert str(refused.value) == _refusal(folder)
    assert _tree(folder) == before


def test_the_cli_refuses_it_in_one_line(tmp_path):
    from conftest import run_cli

    folder = _users_folder(tmp_path)
    before = _tree(folder)
    dataset = _dataset(tmp_path)
    done = run_cli(
        "train", "examples/tiny.yaml", "--set", f"data.dataset={dataset}", "--run-dir", str(folder), timeout=120
    )
    assert done.returncode != 0
    assert done.stderr.strip() == f"error: {_refusal(folder)}", done.stdout + done.stderr
    assert _tree(folder) == before


def test_a_new_an_empty_or_an_earlier_run_folder_is_accepted(tmp_path):
    """Accepted: a new folder, an empty one, one petatrain marked as a run, and a run made
    before the marker (its events.jsonl starts with run_start). Refused: anything else."""
    from petatrain.train import run_dir

    new = tmp_path / "new"
    run_dir.claim(str(new))
    marker = json.loads((new / run_dir.MARKER).read_text())
    assert marker["format"] == "petatrain-run" and marker["version"] == 1
    (new / "config.yaml").write_text("model: {}")
    run_dir.claim(str(new))  # ours: resumed

    (tmp_path / "empty").mkdir()
    run_dir.claim(str(tmp_path / "empty"))

    earlier = tmp_path / "earlier"
    _checkpoint(str(earlier), 10)
    events = [{"t": 1.0, "event": "run_start", "run_id": "ab12cd34"}, {"t": 2.0, "event": "attempt_start"}]
    (earlier / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    run_dir.claim(str(earlier))
    assert (earlier / run_dir.MARKER).exists()

    for name, files in {
        "no-run-start": {"events.jsonl": '{"event": "step"}\n', "config.yaml": "x"},
        "not-json-events": {"events.jsonl": "hello\n"},
        "foreign-marker": {run_dir.MARKER: "hello"},
        "other-format": {run_dir.MARKER: json.dumps({"format": "other", "version": 1})},
        "dotfile": {".DS_Store": "x"},
    }.items():
        folder = tmp_path / name
        for file, text in files.items():
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(text)
        before = _tree(folder)
        with pytest.raises(PetatrainError, match="is a non-empty folder that is not a petatrain run"):
            run_dir.claim(str(folder))
        assert _tree(folder) == before, name

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(PetatrainError, match="is a file, not a folder"):
        run_dir.claim(str(tmp_path / "a-file"))


def test_a_run_refused_under_its_lease_leaves_the_folder_as_it_found_it(tmp_path):
    """A driver refused after it took the lease (a continuation that cannot be carried) leaves no run
    folder behind where there was none, an empty folder the user made empty, and a run as it was."""
    from petatrain.train import run_dir

    (tmp_path / "empty").mkdir()
    for name in ("new", "empty"):
        with pytest.raises(PetatrainError, match="refused"), run_dir.held(str(tmp_path / name)):
            raise PetatrainError("refused")
    assert not (tmp_path / "new").exists() and _tree(tmp_path / "empty") == {}
    with run_dir.held(str(tmp_path / "run")):
        (tmp_path / "run" / "events.jsonl").write_text('{"event": "run_start"}\n')
    with pytest.raises(PetatrainError), run_dir.held(str(tmp_path / "run")):
        raise PetatrainError("refused")
    assert set(_tree(tmp_path / "run")) == {run_dir.MARKER, "events.jsonl"}


def test_retention_deletes_only_the_files_petatrain_wrote(tmp_path):
    """Dropping old checkpoints removes COMMITTED, state.json and the rank files of committed
    petatrain checkpoints; an unknown file in one stays (and so does its folder), and a
    look-alike folder without a petatrain record is not touched at all."""
    run = str(tmp_path)
    _checkpoint(run, 10)
    _checkpoint(run, 20)
    (Path(step_dir(run, 10)) / "notes.txt").write_text("the user's")
    alien = Path(step_dir(run, 5))
    alien.mkdir()
    for name in ("COMMITTED", "state.json", "rank-00000.safetensors", "data.bin"):
        (alien / name).write_text("another tool's")
    odd = tmp_path / "checkpoints" / "step-7"
    odd.mkdir()
    (odd / "COMMITTED").write_text("another tool's")
    before_alien, before_odd = _tree(alien), _tree(odd)

    _checkpoint(run, 30, keep_last=1)
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["step-00000005", "step-00000010", "step-00000030", "step-7"]
    assert _tree(Path(step_dir(run, 10))) == {"notes.txt": b"the user's"}
    assert _tree(alien) == before_alien and _tree(odd) == before_odd
    assert latest_verified(run).step == 30


def test_nothing_is_written_or_deleted_through_a_link_inside_a_run(tmp_path):
    """Attack round 3: retention followed a checkpoint folder linked to another run's and deleted
    that run's checkpoint; a `final/` linked elsewhere had the weights and COMMITTED written
    through it. Links inside a run are refused before a run starts, and never followed after."""
    from petatrain.observe.ledger import EventLog
    from petatrain.runtime.driver import TrainJob, run
    from petatrain.train.checkpoint.final import write_final

    victim = tmp_path / "victim"
    _checkpoint(str(victim), 10)
    (victim / "final").mkdir()
    (victim / "final" / "model.safetensors").write_text("the other run's weights")
    (victim / "final" / "COMMITTED").write_text("the other run's record")
    before = _tree(victim)

    mine = tmp_path / "mine"
    _checkpoint(str(mine), 20)
    (mine / ".petatrain-run").write_text(json.dumps({"format": "petatrain-run", "version": 1, "id": "x"}))
    os.symlink(victim / "checkpoints" / "step-00000010", Path(step_dir(str(mine), 10)))  # older than 20 and 30
    _checkpoint(str(mine), 30, keep_last=1)  # retention would drop 10 and 20
    assert sorted(p.name for p in (mine / "checkpoints").iterdir()) == ["step-00000010", "step-00000030"]
    assert latest_verified(str(mine), below=30) is None  # the link is not one of this run's checkpoints

    os.symlink(victim / "final", mine / "final")
    with pytest.raises(PetatrainError, match=r"final in .*mine is a symbolic link .*remove the link"):
        write_final(str(mine), b"weights", 30)
    os.symlink(victim / "events.jsonl", mine / "events.jsonl")
    with pytest.raises(PetatrainError, match=r"events\.jsonl in .* is a symbolic link"):
        EventLog(str(mine))
    assert _tree(victim) == before

    # Found before a driver writes anything (the lease, config.yaml, the ledger).
    cfg = config.load(ROOT / "examples" / "tiny.yaml", [f"data.dataset={_dataset(tmp_path)}"])
    link = r"is a symbolic link \(to .*victim.*\); petatrain never writes"
    with pytest.raises(PetatrainError, match=link) as refused:
        run(TrainJob(config=cfg, run_url=str(mine), resume=True))
    assert len(str(refused.value).splitlines()) == 1
    assert not (mine / "_lock").exists() and not (mine / "config.yaml").exists()
    assert _tree(victim) == before


# -- one driver per run directory -------------------------------------------------------------


def test_a_second_driver_on_a_run_folder_fails_at_once_naming_the_first(tmp_path):
    """While one driver holds the run folder's lease, another `train` on it ends at once with one
    line naming the holder (host, pid, since when), and writes nothing there."""
    from conftest import run_cli
    from petatrain.runtime.driver import TrainJob, run
    from petatrain.storage import join
    from petatrain.storage.lock import Lease, LeaseHeld
    from petatrain.train import run_dir

    folder = tmp_path / "run"
    dataset = _dataset(tmp_path)
    holder = f"another train pid {os.getpid()} on {socket.gethostname()}, since "
    run_dir.claim(str(folder))  # as the first driver does, then it takes the lease
    with Lease(join(str(folder), "_lock"), kind="train"):
        before = _tree(folder)
        started = time.monotonic()
        with pytest.raises(LeaseHeld) as refused:
            run(
                TrainJob(
                    config=config.load(ROOT / "examples" / "tiny.yaml", [f"data.dataset={dataset}"]),
                    run_url=str(folder),
                )
            )
        assert time.monotonic() - started < 5, "at once, not after starting Ray"
        assert str(refused.value).startswith(f"--run-dir {folder} is in use by {holder}")
        assert "\n" not in str(refused.value)
        assert _tree(folder) == before

        done = run_cli(
            "train", "examples/tiny.yaml", "--set", f"data.dataset={dataset}", "--run-dir", str(folder), timeout=120
        )
        assert done.returncode != 0
        line = done.stderr.strip()
        assert line.startswith(f"error: --run-dir {folder} is in use by {holder}") and "\n" not in line, line
        assert _tree(folder) == before


def test_the_run_folder_is_free_again_however_the_driver_ends(tmp_path, monkeypatch):
    """The lease lasts as long as the run: a driver that fails after taking it lets it go."""
    from petatrain.runtime import cluster
    from petatrain.runtime.driver import TrainJob, run
    from petatrain.storage import join
    from petatrain.storage.lock import Lease

    def no_cluster(*args, **kwargs):
        raise ConnectionError("no Ray cluster")

    monkeypatch.setattr(cluster, "init_ray", no_cluster)
    folder = tmp_path / "run"
    cfg = config.load(ROOT / "examples" / "tiny.yaml", [f"data.dataset={_dataset(tmp_path)}"])
    with pytest.raises(ConnectionError):
        run(TrainJob(config=cfg, run_url=str(folder)))
    assert not (folder / "_lock").exists()
    with Lease(join(str(folder), "_lock"), kind="train"):
        pass
