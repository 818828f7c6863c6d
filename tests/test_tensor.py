"""Tensor parallelism: every layout against the unsplit model (CPU, gloo), one-line refusals, and
(slow) training on Ray: the same steps as DDP, checkpoints resumed across layouts, faults recovered
to the same bits."""

from __future__ import annotations

import contextlib
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers import sha256, start_ranks, tiny, train
from petatrain import config
from petatrain.errors import ConfigError
from petatrain.observe.report import traced_communication

# (parallel.tensor, the replicas' strategy, model, pipeline stages) by world size: 2 x 2 under DDP's and
# FSDP's replicas, 2 tensor-parallel stages; 2 x 2 x 2 (3D) under FSDP's replicas
CASES = {
    2: [(2, "ddp", "gpt", 1), (2, "ddp", "user_model:build_tp", 1)],
    4: [(4, "ddp", "gpt", 1), (2, "ddp", "gpt", 1), (2, "fsdp", "gpt", 1), (2, "ddp", "gpt", 2)],
    8: [(2, "fsdp", "gpt", 2)],
}
STEPS, BATCH = 2, 8


def _job(kind: str, tensor: int, data: str, world: int, optimizer: str, stages: int = 1) -> config.JobConfig:
    sets = [f"model.kind={kind}", "model.n_layer=2", "model.n_head=4", "model.d_model=32", "model.seq_len=16"]
    sets += ["model.vocab_size=64", "model.dropout=0.0", f"parallel.tensor={tensor}"]
    if stages > 1:
        sets += ["parallel.strategy=pipeline", f"parallel.pipeline.stages={stages}", f"parallel.pipeline.data={data}"]
        sets += ["parallel.pipeline.microbatches=2", "parallel.pipeline.partition=parameters"]
    else:
        sets += [f"parallel.strategy={data}"]
    sets += [f"parallel.workers={world}", f"train.global_batch={BATCH}", "train.micro_batch=2"]
    sets += [f"train.optimizer={optimizer}", "train.lr=0.5" if optimizer == "sgd" else "train.lr=0.003"]
    return config.load("examples/tiny.yaml", sets)


def _whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _compare(rank: int, world: int, case: tuple, optimizer: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from petatrain.models import build_model, tied_names
    from petatrain.models.tensor_parallel import canonical
    from petatrain.train import recipe, strategies
    from petatrain.train.checkpoint.tensors import flatten_state

    tensor, data, kind, stages = case
    cfg = _job(kind, tensor, data, world, optimizer, stages)
    torch.manual_seed(0)
    reference = build_model(cfg.model, cfg.train)
    torch.manual_seed(0)
    spec = build_model(cfg.model, cfg.train)
    strategy = strategies.of(cfg)
    steps = strategy.steps(spec, cfg, torch.device("cpu"), world)
    model = steps.model
    opt, ref_opt = recipe.build_optimizer(model, cfg.train), recipe.build_optimizer(reference.module, cfg.train)
    data_rank, data_world, micro = strategy.data_shard(cfg, rank, world)
    tokens = torch.randint(0, 64, (STEPS, BATCH, 17), generator=torch.Generator().manual_seed(1))
    share = BATCH // data_world
    ref_params = dict(reference.module.named_parameters(remove_duplicate=False))
    none = contextlib.nullcontext()
    worst: dict[str, float] = {}

    def note(key: str, value: float) -> None:
        worst[key] = max(worst.get(key, 0.0), value)

    for step in range(STEPS):
        ref_loss = reference.loss_fn(reference.module, tokens[step])
        ref_loss.backward()
        pieces = iter(tokens[step, data_rank * share : (data_rank + 1) * share].split(micro))
        loss = steps.forward_backward(lambda pieces=pieces: next(pieces), none)
        total = loss.detach().clone()
        dist.all_reduce(total)
        note("loss", abs(total.item() / steps.loss_share - ref_loss.item()))
        for name, p in model.named_parameters():  # by name, in the unsplit model's layout (a stage's only)
            grad = _whole(p.grad)
            if name in steps.fused:
                grad = canonical(grad, steps.fused[name], tensor)
            note("grad", float((grad - ref_params[name].grad).abs().max()))
        note("norm", abs(float(steps.clip(1.0)) - float(recipe.clip_gradients(reference.module, 1.0))))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    model.eval()
    reference.module.eval()
    with torch.no_grad():
        mine = steps.eval_loss(tokens[0, data_rank * share : (data_rank + 1) * share], none)
        ref_eval = reference.loss_fn(reference.module, tokens[0, data_rank * share : (data_rank + 1) * share])
        if mine is not None:  # a pipeline's last stage
            note("eval", abs(float(mine) - ref_eval.item()))
    # The checkpoint: whole tensors by name on rank 0, model and optimizer, as the unsplit model's.
    saved_model, saved_optim = strategy.state_dicts(model, opt, rank=rank, cfg=cfg)
    ref_model, ref_optim = get_model_state_dict(reference.module), get_optimizer_state_dict(reference.module, ref_opt)
    if strategy.saves_model(rank, cfg):  # rank 0 all of it; a pipeline's first replica a stage's each
        assert saved_model.keys() == ref_model.keys() or stages > 1
        for name, value in saved_model.items():
            note("saved", float((value - ref_model[name]).abs().max()))
        alias = {n: names[0] for names in tied_names(reference.module) for n in names}  # head.weight: wte.weight's
        for fqn, state in saved_optim["state"].items():
            for key, value in state.items():
                note("saved", float((value - ref_optim["state"][alias.get(fqn, fqn)][key]).abs().max()))
    # ... and one of the unsplit model (a DDP checkpoint) loads into this layout.
    tensors, meta, _ = flatten_state(ref_model, ref_optim, with_model=True)
    torch.manual_seed(5)
    fresh = strategy.steps(build_model(cfg.model, cfg.train), cfg, torch.device("cpu"), world)
    fresh_opt = recipe.build_optimizer(fresh.model, cfg.train)
    groups = [
        {**g, "params": [n for n in g["params"] if n in dict(fresh.model.named_parameters())]}
        for g in meta["param_groups"]
    ]
    state = SimpleNamespace(world_size=1, strategy="ddp", param_groups=groups if stages > 1 else meta["param_groups"])
    strategy.load_into(fresh.model, fresh_opt, state, {0: tensors}, rank=rank)
    loaded = fresh.full_state()
    if rank == 0:
        note("loaded", max(float((loaded[k] - ref_model[k]).abs().max()) for k in ref_model))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, worst)
    return {k: max(w.get(k, 0.0) for w in gathered) for k in gathered[0]}


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    try:
        for case in CASES[world]:
            for optimizer in ("sgd", "adamw"):
                results[(*case, optimizer)] = _compare(rank, world, case, optimizer)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_every_layout_matches_the_unsplit_model(tmp_path, world):
    """Loss, every gradient by name, the clipping norm, the weights after 2 steps, the evaluation
    loss, the checkpoint's tensors and a DDP checkpoint loaded: the unsplit model's, fp32 on gloo."""
    out = str(tmp_path / "results.pt")
    start_ranks(_worker, (world, f"file://{tmp_path}/store", out), world)
    results = torch.load(out)
    assert len(results) == 2 * len(CASES[world])
    for case, worst in results.items():
        assert worst["loss"] < 1e-6 and worst["grad"] < 1e-6 and worst["norm"] < 1e-5, (case, worst)
        assert worst.get("eval", 0.0) < 1e-6 and worst["loaded"] == 0.0, (case, worst)
        # SGD moves the weights by the gradients; AdamW divides each by its own running size, which
        # turns a 1e-8 difference in a gradient near zero into up to lr x 1e-3.
        assert worst["saved"] < (1e-6 if case[-1] == "sgd" else 1e-5), (case, worst)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["parallel.tensor=3", "parallel.workers=3"], "model.n_head 2 is not divisible by parallel.tensor 3"),
        (["parallel.tensor=2", "parallel.workers=3"], "must be a multiple of 2"),
        (["parallel.tensor=0"], "parallel.tensor: need >= 1"),
        (["parallel.tensor=2", "model.kind=mlp"], "model.kind mlp has no tensor-parallel plan"),
        (
            ["parallel.tensor=2", "parallel.strategy=pipeline", "parallel.workers=4", "model.vocab_size=321"],
            "model.vocab_size 321 is not divisible by parallel.tensor 2",
        ),
        (["parallel.tensor=2", "parallel.strategy=pipeline", "parallel.workers=2"], "must be a multiple of 4"),
    ],
)
def test_layouts_that_cannot_split_are_one_line_before_workers_start(sets, message):
    from petatrain.train import strategies

    with pytest.raises(ConfigError, match=message) as caught:
        strategies.of(config.load("examples/tiny.yaml", sets)).check_config(config.load("examples/tiny.yaml", sets))
    assert "\n" not in str(caught.value)


# -- on Ray: the tiny GPT of the other training tests, 2 tensor-parallel ranks ----------------------


THREE_D = [
    "parallel.strategy=pipeline", "parallel.pipeline.stages=2", "parallel.pipeline.microbatches=4",
    "parallel.pipeline.partition=parameters", "parallel.tensor=2", "parallel.workers=4",
    "resources.cpus_per_worker=0.5",
]  # fmt: skip


def _losses(run_dir) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in lines if e["event"] == "step"}


def _from_checkpoint(run_dir, to, step: int):
    """A copy of `run_dir` as it was when checkpoint `step` was its newest."""
    shutil.copytree(run_dir, to)
    for folder in (to / "checkpoints").iterdir():
        if int(folder.name.removeprefix("step-")) > step:
            shutil.rmtree(folder)
    shutil.rmtree(to / "final")
    return to


def _weights_differ(a, b) -> float:
    ours, theirs = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    return max(float((ours[k] - theirs[k]).abs().max()) for k in ours)


@pytest.fixture(scope="module")
def tensor_run(token_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tensor")
    summary = train(tiny(token_dataset, "parallel.tensor=2"), run_dir)
    assert summary["attempts"] == 1 and summary["failures"] == []
    return run_dir


@pytest.mark.slow
def test_tensor_parallel_trains_as_ddp_and_its_checkpoints_resume_in_any_layout(
    tensor_run, baseline, token_dataset, tmp_path
):
    """2 tensor-parallel ranks train as 2 DDP ranks do, step for step; the checkpoint of step 20
    resumes on DDP, and DDP's on 2 pipeline stages each split by 2 tensor-parallel ranks (4 ranks):
    the same next 10 steps, from the loader's position; serving reads a tensor-parallel checkpoint
    as any other."""
    from petatrain.train import weights

    tp, ddp = _losses(tensor_run), _losses(baseline)
    assert sorted(tp) == sorted(ddp) == list(range(1, 31))
    assert max(abs(tp[s] - ddp[s]) for s in tp) < 1e-5
    assert _weights_differ(tensor_run, baseline) < 1e-5
    to_ddp = _from_checkpoint(tensor_run, tmp_path / "to-ddp", 20)
    assert train(tiny(token_dataset), to_ddp)["failures"] == []
    resumed = _losses(to_ddp)
    assert max(abs(resumed[s] - ddp[s]) for s in range(21, 31)) < 1e-5
    to_3d = _from_checkpoint(baseline, tmp_path / "to-3d", 20)
    trace = ["observe.profile_at=30", "observe.profile_steps=1"]  # the last step (its checkpoint's gathers too)
    assert train(tiny(token_dataset, *THREE_D, *trace), to_3d)["failures"] == []
    resumed = _losses(to_3d)
    assert max(abs(resumed[s] - ddp[s]) for s in range(21, 31)) < 1e-5
    assert _weights_differ(to_3d, baseline) < 1e-5
    # Its traced steps: each rank's tensor-parallel all-reduces, the stages' sends and receives, the
    # tied embedding summed between the stages, told apart by their groups (the report's mesh table)
    traced = traced_communication(str(to_3d))
    assert [(t["attempt"], t["rank"]) for t in traced] == [(1, r) for r in range(4)]
    for t in traced:
        dims = t["dimensions"]
        assert (
            t["complete"] and t["unattributed_ms"] == 0 and set(dims) == {"tensor", "pipeline", "tied weights", "world"}
        )
        assert dims["tensor"]["calls"] > 8 and dims["tensor"]["mib"] > 1 and dims["pipeline"]["calls"] == 8
        assert 0 < dims["tensor"]["ms"] < t["step_ms"] and dims["tied weights"]["calls"] == 1
    served = weights.load(str(tensor_run), "20")
    assert served.step == 20 and served.weights["blocks.0.attn.qkv.weight"].shape == (3 * 64, 64)


@pytest.mark.slow
@pytest.mark.chaos
def test_every_fault_in_a_tensor_parallel_run_ends_in_the_same_bits(tensor_run, token_dataset, tmp_path):
    """kill, exception, hang and preemption in one tensor-parallel run: the uninterrupted run's sha256."""
    # after the first checkpoint (step 10), so that no attempt starts again from step 0
    specs = ["kill@step=12,rank=1", "raise@step=16,rank=0", "hang@step=22,rank=1", "preempt@step=26,rank=0"]
    summary = train(tiny(token_dataset, "parallel.tensor=2"), tmp_path, *specs)
    assert [f["cause"] for f in summary["failures"]] == ["kill", "exception", "hang", "preempt"]
    assert sha256(tmp_path / "final" / "model.safetensors") == sha256(tensor_run / "final" / "model.safetensors")
