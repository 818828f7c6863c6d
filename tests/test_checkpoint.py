"""Checkpoints without a cluster: what is written, what is loaded, what is refused, resharding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT
from petatrain import config
from petatrain.errors import ConfigError


def _meta(position: int) -> dict:
    """What the training loop puts in every checkpoint record besides the files."""
    groups = [{"lr": 0.001, "weight_decay": 0.1, "params": ["w"]}]
    return {"loader": {"position": position}, "strategy": "ddp", "param_groups": groups, "config_digest": "0123abcd"}


def _one_rank_writer(run: str):
    """A checkpoint writer of a run of one rank: its own part is all the parts."""
    from petatrain.train.checkpoint import CheckpointWriter

    parts: dict = {}
    return CheckpointWriter(
        run,
        None,
        report_part=lambda s, r, f: parts.__setitem__(s, f),
        wait_parts=lambda s, w, t: parts.get(s),
        on_commit=lambda info: None,
    )


def _write_checkpoint(run: str, step: int, value: float, keep_last: int = 10, keep_every: int = 0) -> None:
    import torch

    from helpers import write_checkpoint

    write_checkpoint(run, step, {"model/w": torch.full((4, 4), value)}, keep_last=keep_last, keep_every=keep_every)


def test_torn_truncated_and_corrupt_checkpoints_are_never_loaded(tmp_path):
    """Torn (no COMMITTED) and truncated checkpoints are skipped when one is chosen; a flipped
    byte or a garbled header is caught as the rank file loads, and resume falls back further."""
    from petatrain.errors import CorruptDataError
    from petatrain.train.checkpoint import latest_verified, read_rank_tensors, step_dir

    run = str(tmp_path)
    for step in (10, 20, 30, 40, 50):
        _write_checkpoint(run, step, float(step))

    def rank_file(step: int) -> Path:
        return Path(step_dir(run, step)) / "rank-00000.safetensors"

    (Path(step_dir(run, 50)) / "COMMITTED").unlink()  # torn: crashed before the marker
    rank_file(40).write_bytes(rank_file(40).read_bytes()[:-1])  # truncated
    data = bytearray(rank_file(30).read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the tensor data
    rank_file(30).write_bytes(bytes(data))
    data = bytearray(rank_file(20).read_bytes())
    data[5] = 0x7F  # the header's length now claims ~140 TB: refused before anything is allocated
    rank_file(20).write_bytes(bytes(data))

    skipped = []
    state = latest_verified(run, on_skip=lambda url, why: skipped.append((url, why)))
    assert state.step == 30
    assert [url.rsplit("/", 1)[-1] for url, _ in skipped] == ["step-00000040"]
    assert "rank-00000.safetensors has" in skipped[0][1] and "does not verify" in skipped[0][1]
    with pytest.raises(CorruptDataError, match=r"step-00000030 does not verify: rank-00000.safetensors: checksum"):
        read_rank_tensors(run, state, 0)
    state = latest_verified(run, below=30)
    with pytest.raises(CorruptDataError, match=r"step-00000020 does not verify: rank-00000.safetensors: header length"):
        read_rank_tensors(run, state, 0)
    state = latest_verified(run, below=20)
    assert state.step == 10 and state.loader == {"position": 10}
    assert float(read_rank_tensors(run, state, 0)["model/w"][0, 0]) == 10.0


def test_rank_files_load_as_safetensors_writes_them(tmp_path):
    """The streamed reader gives back exactly what safetensors saved, for every dtype a checkpoint holds."""
    import torch
    from safetensors.torch import save_file

    from petatrain.storage.checksum import checksum_file
    from petatrain.train.checkpoint import CheckpointState, read_rank_tensors, step_dir

    saved = {
        "model/w": torch.randn(3, 5),
        "model/h": torch.randn(2, 2).half(),
        "optim/w/exp_avg": torch.randn(7).bfloat16(),
        "optim/w/step": torch.tensor(3.0),
        "model/empty": torch.empty(0, 4),
        "rng/cpu": torch.get_rng_state(),
        "model/index": torch.arange(10),
        "model/mask": torch.tensor([True, False, True]),
    }
    path = Path(step_dir(str(tmp_path), 1)) / "rank-00000.safetensors"
    path.parent.mkdir(parents=True)
    save_file(saved, str(path), metadata={"step": "1"})
    info = {"checksum": checksum_file(str(path)), "bytes": path.stat().st_size}
    state = CheckpointState(
        step=1, world_size=1, strategy="ddp", files={path.name: info}, loader={}, param_groups=[], time=0.0
    )
    loaded = read_rank_tensors(str(tmp_path), state, 0)
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_live_snapshot_is_written_as_taken_and_refused_if_it_changed(tmp_path):
    """A live snapshot references the weights (no copy) and is committed as they were; one whose
    weights changed before the writer had read them is not committed, and copying takes over."""
    import torch

    from petatrain.train.checkpoint import (
        HostBuffers,
        Snapshot,
        committed_steps,
        flatten_state,
        latest_verified,
        read_rank_tensors,
    )

    weight = torch.arange(6.0).reshape(2, 3)
    exp_avg = torch.ones(2, 3)
    model_sd = {"w": weight, "tied": weight}
    optim_sd = {"state": {"w": {"exp_avg": exp_avg}}, "param_groups": [{"lr": 0.1}]}
    ptrs = frozenset({weight.data_ptr(), exp_avg.data_ptr()})
    writer = _one_rank_writer(str(tmp_path))

    def snapshot(step: int) -> Snapshot:
        tensors, meta, live = flatten_state(model_sd, optim_sd, with_model=True, buffers=HostBuffers(), live_ptrs=ptrs)
        assert tensors["model/w"].data_ptr() == weight.data_ptr(), "referenced, not copied"
        assert tensors["model/tied"].data_ptr() != weight.data_ptr(), "a storage saved twice is copied"
        versions = [t._version for t in live]
        meta = {**_meta(step), **meta}
        return Snapshot(step=step, rank=0, world_size=1, tensors=tensors, meta=meta, live=live, versions=versions)

    writer.submit(snapshot(1))
    writer.wait_for_staging()
    weight.add_(100.0)  # optimizer.step, after the staging
    writer.wait()
    assert writer.error is None and not writer.live_refused
    state = latest_verified(str(tmp_path))
    assert torch.equal(read_rank_tensors(str(tmp_path), state, 0)["model/w"], torch.arange(6.0).reshape(2, 3))

    changed = snapshot(2)
    weight.add_(1.0)  # written before the writer has read it
    writer.submit(changed)
    writer.close()
    assert "weights changed while they were written" in str(writer.error) and writer.live_refused
    assert committed_steps(str(tmp_path)) == [1]
    assert not list(tmp_path.glob("checkpoints/step-00000002/*")), "nothing of the torn snapshot was published"


def test_a_snapshot_staged_on_the_device_is_moved_to_the_host_by_the_writer(tmp_path):
    """On a GPU with room a snapshot is a copy made on the device, which the writer's thread moves to
    reused host buffers (`DeviceStage.fill`) while training goes on: the file holds the copy, not the
    weights changed since; the host buffers are made once. Here the staged copies are CPU tensors
    (this machine has no GPU): the same hand-over, without the stream; gpu.py checks the CUDA one."""
    import torch

    from petatrain.train.checkpoint import (
        DeviceStage,
        HostBuffers,
        Snapshot,
        latest_verified,
        read_rank_tensors,
    )

    weight = torch.arange(6.0).reshape(2, 3)
    buffers = HostBuffers(device_staging=True)
    writer = _one_rank_writer(str(tmp_path))
    hosts = []
    for step in (1, 2):
        staged = {"model/w": weight.clone()}  # the device-to-device copy
        snap = Snapshot(
            step=step, rank=0, world_size=1, tensors=dict(staged), meta=_meta(step),
            pending=DeviceStage(["model/w"], buffers.host_buffer, weight.device),
        )  # fmt: skip
        writer.submit(snap)
        expected = weight.clone()
        weight.add_(100.0)  # the next update, at once
        writer.wait()
        assert writer.error is None
        hosts.append(snap.tensors["model/w"])
        assert snap.tensors["model/w"] is not staged["model/w"], "the host buffer replaced the staged copy"
        assert torch.equal(read_rank_tensors(str(tmp_path), latest_verified(str(tmp_path)), 0)["model/w"], expected)
    writer.close()
    assert hosts[0] is hosts[1], "the host buffers are reused"


# gloo's worker thread can drop its last reference to a finished all-gather after wait() has returned;
# if that happens while Python finalizes, the tensors' decref takes the GIL, which calls pthread_exit inside
# a noexcept frame: std::terminate and exit -6 (seen in CI; 2 of 15 runs of the reshard load here).
# Leave without finalizing once every file is written (os._exit: the ranks below end so).


def _watch_rank(rank: int, strategy: str, out: str) -> None:
    """A rank alone (forked by start_ranks): the live tensors' version counters through backward and
    optimizer.step, written to `out` as [live tensors, moved in backward, moved in step]."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    from petatrain.models import build_model
    from petatrain.train import checkpoint as ckpt
    from petatrain.train.parallel import parallelize, state_for_save
    from petatrain.train.recipe import build_optimizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = config.load(ROOT / "examples" / "tiny.yaml", [f"parallel.strategy={strategy}"])
    spec = build_model(cfg.model, cfg.train)
    model = parallelize(spec, cfg, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.train)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    spec.loss_fn(model, tokens).backward()
    optimizer.step()
    _, _, live = state_for_save(model, optimizer, rank=0, cfg=cfg, buffers=ckpt.HostBuffers(), live=True)
    versions = [t._version for t in live]
    spec.loss_fn(model, tokens).backward()
    after_backward = sum(v != t._version for v, t in zip(versions, live, strict=True))
    optimizer.step()
    after_step = sum(v != t._version for v, t in zip(versions, live, strict=True))
    Path(out).write_text(json.dumps([len(live), after_backward, after_step]))
    dist.destroy_process_group()
    os._exit(0)  # not through finalization: gloo's thread (see above)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_live_snapshot_guard_sees_every_change_optimizer_step_makes(strategy, tmp_path):
    """The writer's guard watches version counters: every live tensor's moves in optimizer.step
    (FSDP's sharded DTensors bump only their own, not their local tensor's), none in forward/backward."""
    from helpers import start_ranks

    start_ranks(_watch_rank, (strategy, str(tmp_path / "counts.json")), 1)
    live, after_backward, after_step = json.loads((tmp_path / "counts.json").read_text())
    assert live > 50 and after_backward == 0 and after_step == live, (live, after_backward, after_step)


def test_reshard_copies_each_ranks_rows_out_of_the_old_files_that_hold_them():
    import torch

    from petatrain.errors import CorruptDataError
    from petatrain.train.strategies.fsdp import chunk_rows, reshard

    for rows in (1, 2, 5, 10):  # FSDP2 splits dim 0 as torch.chunk does, empty chunks at the end
        for world in (1, 2, 3, 4):
            sizes = [len(c) for c in torch.chunk(torch.arange(rows), world)]
            sizes += [0] * (world - len(sizes))
            assert [end - first for first, end in (chunk_rows(rows, world, r) for r in range(world))] == sizes
    full = {
        "model/w": torch.arange(30.0).reshape(10, 3),
        "optim/w/exp_avg": -torch.arange(30.0).reshape(10, 3),
        "optim/w/step": torch.tensor(7.0),  # replicated: in every file
        "model/tiny": torch.tensor([1.0, 2.0]),  # fewer rows than ranks: some shards are empty
        "model/buffer": torch.tensor([3.0, 4.0, 5.0]),  # not a sharded parameter: replicated
    }
    sharded = {"w": 10, "tiny": 2}

    def files_of(world: int) -> dict[int, dict]:
        files = {}
        for k in range(world):
            files[k] = {"rng/cpu": torch.tensor([k], dtype=torch.uint8)}
            for name, tensor in full.items():
                fqn = name.split("/")[1]
                first, end = chunk_rows(tensor.shape[0], world, k) if fqn in sharded and tensor.dim() else (0, None)
                files[k][name] = tensor[first:end].clone() if end is not None else tensor.clone()
        return files

    for old in (1, 2, 3, 4):
        files = files_of(old)
        for new in (1, 2, 3, 4):
            for rank in range(new):
                layout = {fqn: (n, *chunk_rows(n, new, rank)) for fqn, n in sharded.items()}
                read = []
                got = reshard(lambda k: read.append(k) or files[k], layout, old)  # noqa: B023
                assert set(got) == set(full), "the old ranks' RNG streams are not this rank's"
                for name, tensor in full.items():
                    first, end = layout.get(name.split("/")[1], (0, 0, None))[1:]
                    expected = tensor[first:end] if end is not None and tensor.dim() else tensor
                    assert torch.equal(got[name], expected), (old, new, rank, name)
                holders = [
                    k
                    for k in range(old)
                    for n, first, end in layout.values()
                    if max(first, chunk_rows(n, old, k)[0]) < min(end, chunk_rows(n, old, k)[1])
                ]
                assert read == (sorted(set(holders)) or [0]), (old, new, rank)  # only the files holding its rows
    files = files_of(3)
    files[1]["model/w"] = files[1]["model/w"][:-1]
    with pytest.raises(
        CorruptDataError, match=r"rank-00001\.safetensors: model/w has 3 rows; 10 rows over 3 ranks gives it 4"
    ):
        reshard(lambda k: files[k], {"w": (10, 0, 5), "tiny": (2, 0, 1)}, 3)


def _reshard_rank(rank: int, phase: str, folder: str, world: int, old_world: int) -> None:
    """One rank of the reshard test (a process forked by start_ranks): `save` FSDP shards of a
    trained step, or `load` them on another world size; each rank writes the files it read."""
    import os

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from petatrain.models import build_model
    from petatrain.train import checkpoint as ckpt
    from petatrain.train.parallel import load_into, parallelize, read_for_resume, state_for_save
    from petatrain.train.recipe import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{phase}", rank=rank, world_size=world)
    # d_model 40: most dims (40, 120, 160, 320, 64 rows) split unevenly over 3 ranks
    cfg = config.load(ROOT / "examples" / "tiny.yaml", ["parallel.strategy=fsdp", "model.d_model=40"])
    torch.manual_seed(0 if phase == "save" else 1)
    spec = build_model(cfg.model, cfg.train)
    model = parallelize(spec, cfg, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.train)
    if phase == "save":
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
        spec.loss_fn(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tensors, meta, _ = state_for_save(model, optimizer, rank=rank, cfg=cfg, buffers=ckpt.HostBuffers())
        save_file(tensors, f"{folder}/rank-{rank}.safetensors")
        if rank == 0:
            Path(f"{folder}/groups.json").write_text(json.dumps(meta["param_groups"]))
    else:
        read: list[int] = []

        def load(k: int) -> dict:
            read.append(k)
            return load_file(f"{folder}/rank-{k}.safetensors")

        groups = json.loads(Path(f"{folder}/groups.json").read_text())
        state = ckpt.CheckpointState(
            step=1, strategy="fsdp", world_size=old_world, param_groups=groups, files={}, loader={}, time=0.0
        )
        shards = read_for_resume(state, load, model=model, rank=rank, world=world, cfg=cfg)
        load_into(model, optimizer, state, shards, rank=rank, cfg=cfg)
        Path(f"{folder}/read-{rank}.json").write_text(json.dumps(read))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
    if rank == 0:
        save_file(ckpt.flatten_state(model_sd, optim_sd, with_model=True)[0], f"{folder}/full-{phase}.safetensors")
    dist.destroy_process_group()
    os._exit(0)  # not through finalization: gloo's thread (see above)


@pytest.mark.parametrize(("old_world", "new_world", "reads"), [(3, 2, [[0, 1], [1, 2]]), (2, 3, [[0], [0, 1], [1]])])
def test_fsdp_checkpoint_loads_on_another_world_size_reading_only_the_rows_each_rank_holds(
    tmp_path, old_world, new_world, reads
):
    """Shards of 3 ranks load on 2 and back: the full model and optimizer state are exactly the
    saved ones, and each rank read only the old files that hold its rows."""
    import torch
    from safetensors.torch import load_file

    from helpers import start_ranks

    start_ranks(_reshard_rank, ("save", str(tmp_path), old_world, old_world), old_world)
    start_ranks(_reshard_rank, ("load", str(tmp_path), new_world, old_world), new_world)
    assert [json.loads((tmp_path / f"read-{r}.json").read_text()) for r in range(new_world)] == reads
    saved, loaded = load_file(tmp_path / "full-save.safetensors"), load_file(tmp_path / "full-load.safetensors")
    assert set(saved) == set(loaded) and len(saved) > 20
    for name, tensor in saved.items():
        assert torch.equal(tensor, loaded[name]), name


def test_staging_choice_keeps_the_cheaper_of_copy_and_live():
    from petatrain.train.loop import StagingChoice

    auto = StagingChoice("auto", available=True, retry_every=4)
    taken = []
    for _ in range(9):
        live = auto.live()
        taken.append(live)
        auto.observed(live, 0.01 if live else 0.3)  # live is cheaper: the next step never waits
    # copy once, live once, then live, except every 4th checkpoint retries copying
    assert taken == [False, True, True, True, False, True, True, True, False]
    slow = StagingChoice("auto", available=True)
    for _ in range(2):
        live = slow.live()
        slow.observed(live, 2.0 if live else 0.3)  # the next optimizer.step waited 2 s for the write
    assert not slow.live()
    assert not auto.live(refused=True), "a live snapshot changed under the writer: copies only"
    assert not StagingChoice("live", available=False).live(), "GPU: host copies"
    assert StagingChoice("live", available=True).live() and not StagingChoice("copy", available=True).live()


def test_retention_keeps_the_last_k_and_every_mth(tmp_path):
    run = str(tmp_path)
    for step in (10, 20, 30, 40, 50):
        _write_checkpoint(run, step, 1.0, keep_last=2, keep_every=20)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-00000020",
        "step-00000040",
        "step-00000050",
    ]


def test_user_model_factory_and_bad_factories():
    from petatrain.models import build_model

    spec = build_model(config.ModelConfig(kind="user_model:build", vocab_size=50))
    import torch

    loss = spec.loss_fn(spec.module, torch.randint(0, 50, (2, 9)))
    assert loss.ndim == 0 and loss.item() > 0
    with pytest.raises(ConfigError, match="must return"):
        build_model(config.ModelConfig(kind="user_model:not_a_model"))
    with pytest.raises(ConfigError, match="cannot load"):
        build_model(config.ModelConfig(kind="no_such_module:build"))


def test_auto_checkpoint_interval_is_young_daly():
    from petatrain.train.recipe import CheckpointSchedule, young_daly_interval

    cfg = config.load(None, ["checkpoint.every=auto", "faults.mtbf_hours=2"])
    schedule = CheckpointSchedule(cfg, world=2)  # job MTBF: 1 hour over 2 nodes
    assert schedule.interval_s() == 10.0  # one early checkpoint measures the cost
    schedule.taken(stall_s=0.5, write_s=3.0)
    assert schedule.interval_s() == pytest.approx(young_daly_interval(0.5, 3600))  # ~sqrt(2 * stall * MTBF) = 60 s
    assert schedule.interval_s() == pytest.approx((2 * 0.5 * 3600) ** 0.5, rel=0.01)
    schedule.taken(stall_s=0.5, write_s=100.0)
    assert schedule.interval_s() == 100.0, "never faster than a write completes"

    # Training on CPU, the background write takes its CPU time from the loop: it is part of the cost.
    cpu = CheckpointSchedule(cfg, world=2, writer_competes=True)
    cpu.taken(stall_s=0.5, write_s=3.0, write_cpu_s=1.5)
    assert cpu.interval_s() == pytest.approx(young_daly_interval(2.0, 3600))  # ~120 s
    gpu = CheckpointSchedule(cfg, world=2, writer_competes=False)
    gpu.taken(stall_s=0.5, write_s=3.0, write_cpu_s=1.5)
    assert gpu.interval_s() == pytest.approx(young_daly_interval(0.5, 3600))


def test_the_kept_state_dicts_are_torchs_own_after_steps_a_new_learning_rate_and_a_load(tmp_path):
    """A snapshot keeps `get_model_state_dict`/`get_optimizer_state_dict` from one checkpoint to the
    next (`strategies.base.StateDicts`): after updates, a learning-rate change and a load of the optimizer's
    state (new tensors), what it gives equals what torch gives then, name for name and value for value."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from petatrain.models import build_model
    from petatrain.train import recipe
    from petatrain.train.strategies.base import StateDicts

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        cfg = config.load(ROOT / "examples" / "tiny.yaml", [])
        spec = build_model(cfg.model, cfg.train)
        model = DistributedDataParallel(spec.module)
        optimizer = recipe.build_optimizer(model, cfg.train)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
        kept = StateDicts()

        def same() -> None:
            model_sd, optim_sd = kept.get(model, optimizer)
            fresh_model, fresh_optim = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
            assert list(model_sd) == list(fresh_model)
            assert all(torch.equal(model_sd[k], v) for k, v in fresh_model.items())
            assert optim_sd["param_groups"] == fresh_optim["param_groups"]
            assert list(optim_sd["state"]) == list(fresh_optim["state"])
            for fqn, state in fresh_optim["state"].items():
                assert list(optim_sd["state"][fqn]) == list(state)
                assert all(torch.equal(optim_sd["state"][fqn][k], v) for k, v in state.items())

        same()  # no optimizer state yet
        for step in range(3):
            recipe.set_lr(optimizer, step, cfg.train)
            spec.loss_fn(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            same()
        saved = optimizer.state_dict()
        optimizer.load_state_dict(
            {**saved, "state": {k: {n: t.clone() + 1 for n, t in v.items()} for k, v in saved["state"].items()}}
        )
        same()
    finally:
        dist.destroy_process_group()
