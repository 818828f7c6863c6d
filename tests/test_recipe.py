"""`profile` runs exactly the step `train` runs, and `plan` models the micro-batching `train` uses.

Both are built from one config: `train`'s side as the worker loop builds it (the strategy's
wrapper, the recipe's optimizer and micro-batching) and steps it (`train.steps.MicroBatches.forward_backward`,
`recipe.apply_gradients`); `profile`'s side is `plan.profile.TrainStep`. Same optimizer class
and parameter groups, same accumulation, same loss, and after a step the same weights, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from petatrain import config
from petatrain.plan import estimate as est
from petatrain.plan.profile import TrainStep
from petatrain.plan.recommend import PlanRequest, plan
from petatrain.train import loop, recipe
from petatrain.train.parallel import step_runner


class FixedTokens:
    """The same micro-batches, in the same order, for both sides."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches, self.i, self.wait_s = batches, 0, 0.0

    def next(self) -> torch.Tensor:
        tokens = self.batches[self.i % len(self.batches)]
        self.i += 1
        return tokens


def _groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[dict]:
    """param_groups with parameters by name (a DDP wrapper's `module.` prefix dropped)."""
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": sorted(names[id(p)] for p in g["params"])}
        for g in optimizer.param_groups
    ]


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_profile_runs_the_step_train_runs(process_group, optimizer):
    cfg = config.load(
        None,
        [
            "model.n_layer=2",
            "model.d_model=32",
            "model.n_head=2",
            "model.seq_len=16",
            "model.vocab_size=64",
            "train.global_batch=8",
            "train.micro_batch=4",
            "train.grad_clip=0.05",  # clipping acts on this step
            f"train.optimizer={optimizer}",
        ],
    )
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 17), generator=gen) for _ in range(2)]

    # train: as the worker loop builds and steps it, on one rank
    torch.manual_seed(cfg.train.seed)
    spec = loop.build_model(cfg.model, cfg.train)
    steps = step_runner(spec, cfg, device, 1)
    model = steps.model
    train_opt = recipe.build_optimizer(model, cfg.train)
    accumulation = steps.accumulation
    recipe.set_lr(train_opt, 0, cfg.train)
    train_loss = steps.forward_backward(FixedTokens(batches).next, recipe.autocast(cfg.train, device))
    grad_norm, _ = recipe.apply_gradients(model, train_opt, cfg.train, clip=steps.clip)

    # profile
    profiled = TrainStep(cfg, device, FixedTokens(batches))
    profile_loss = profiled.run()

    assert type(profiled.optimizer) is type(train_opt)
    assert _groups(profiled.optimizer, profiled.model) == _groups(train_opt, model)
    assert [g["weight_decay"] for g in train_opt.param_groups] == [0.1, 0.0], "matrices decay, vectors do not"
    assert profiled.accumulation == accumulation == 2
    assert grad_norm > cfg.train.grad_clip
    assert torch.equal(profile_loss, train_loss)
    trained = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    for name, weight in profiled.model.named_parameters():
        assert torch.equal(weight, trained[name]), name


def test_plan_takes_the_micro_batch_train_runs():
    """256 sequences over 64 devices is 4 per device: train runs micro-batches of 4 (not the
    configured 8), and so does the plan's estimate; 3 devices cannot split it at all."""
    cfg = config.load(None, ["train.global_batch=256", "train.micro_batch=8"])
    assert recipe.micro_batching(cfg.train, 64) == (4, 1)
    (c,) = plan(cfg, PlanRequest(accelerator="H100-SXM", count=64, strategies=("ddp",))).candidates
    assert c.feasible
    w = est.Workload.from_config(cfg).with_micro_batch(4)
    assert c.memory.activations == est.memory_per_device(w, strategy="ddp", count=64, accumulation=1).activations
    (odd,) = plan(cfg, PlanRequest(accelerator="H100-SXM", count=3, strategies=("ddp",))).candidates
    assert not odd.feasible and "not divisible by 3" in odd.reason


TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=8", "model.vocab_size=32"]


def test_train_compile_loads_and_the_loop_compiles_the_model_in_place(tmp_path):
    """`train.compile: true` compiles the forward where the worker builds the model; in place, so the
    parameter names checkpoints and serve rely on stay the model's own (no `_orig_mod.` prefix).
    Only built here: running it would compile (seconds of inductor), and the GPU check runs it."""
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  compile: true\n")
    cfg = config.load(job, TINY)
    assert cfg.train.compile is True
    spec = loop._build_model(cfg)
    assert spec.module._compiled_call_impl is not None
    plain = loop._build_model(config.load(None, TINY))
    assert plain.module._compiled_call_impl is None, "off by default"
    assert list(spec.module.state_dict()) == list(plain.module.state_dict())


def test_the_optimizer_keeps_single_tensor_kernels_on_the_cpu():
    """plan's CPU memory model counts foreach=False AdamW's temporaries; the fused kernel is CUDA's only."""
    cfg = config.load(None, TINY)
    optimizer = recipe.build_optimizer(loop.build_model(cfg.model, cfg.train).module, cfg.train)
    assert optimizer.defaults["foreach"] is False and not optimizer.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_optimizer_is_fused_on_cuda():
    cfg = config.load(None, TINY)
    optimizer = recipe.build_optimizer(loop.build_model(cfg.model, cfg.train).module.cuda(), cfg.train)
    assert optimizer.defaults["fused"] is True


def test_a_fused_optimizer_drops_a_non_finite_update_without_the_host_reading_the_norm():
    """On a GPU the fused AdamW decides from a flag on the device (its `found_inf`), so the step reads
    the norm once, with the loss and the flags, not between backward and the update. The same
    kernel's CPU build shows it here: a finite step updates as the host-decided one does; a NaN
    gradient leaves the weights, both moments and the step count as they were."""
    torch.manual_seed(0)
    cfg = config.load(None, TINY)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = torch.optim.AdamW(models[0].parameters(), lr=0.1, fused=True)
    host = torch.optim.AdamW(models[1].parameters(), lr=0.1, foreach=False)
    assert recipe.skips_on_device(fused) and not recipe.skips_on_device(host)
    x = torch.randn(5, 8)
    flags = recipe.step_flags(torch.tensor(2.5), (False, True, False, False))
    for model in models:
        model(x).square().sum().backward()
    (device_norm, _), (host_norm, _) = (
        recipe.apply_gradients(m, o, cfg.train) for m, o in zip(models, (fused, host), strict=True)
    )
    assert isinstance(device_norm, torch.Tensor) and isinstance(host_norm, float)
    values, norm = recipe.read_step(flags, device_norm)
    assert values == [2.5, 0.0, 1.0, 0.0, 0.0] and norm == pytest.approx(host_norm) and norm > cfg.train.grad_clip
    assert recipe.read_step(flags, host_norm) == (values, host_norm)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b)

    weights = {k: v.clone() for k, v in models[0].state_dict().items()}
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in fused.state.items()}
    (models[0](x).sum() * float("nan")).backward()
    _, norm = recipe.read_step(flags, recipe.apply_gradients(models[0], fused, cfg.train)[0])
    assert norm != norm  # NaN: the loop records it and does what faults.nonfinite says
    assert all(torch.equal(weights[k], v) for k, v in models[0].state_dict().items())
    assert all(torch.equal(state[p][k], v) for p, s in fused.state.items() for k, v in s.items())
    assert all(p.grad is None for p in models[0].parameters())
