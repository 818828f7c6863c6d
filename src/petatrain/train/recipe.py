"""The training recipe: optimizer, learning-rate schedule, micro-batching, checkpoint interval.

One definition, used by `train` (train/loop.py), `profile` (plan/profile.py) and `plan`
(plan/recommend.py, plan/estimate.py), so that the step `profile` measures and `plan`
models is the step `train` runs (tests/test_recipe.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

from petatrain.config import JobConfig, TrainConfig
from petatrain.errors import ConfigError

if TYPE_CHECKING:  # plan imports this module and must not pay for torch
    import torch


def param_groups(model: torch.nn.Module, train: TrainConfig) -> list[dict[str, Any]]:
    """Weight decay on matrices only (as GPT-2/nanoGPT): norms, biases and other vectors are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": train.weight_decay}, {"params": other, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (betas train.beta1/beta2) or SGD with momentum train.beta1, over `param_groups`."""
    import torch

    groups = param_groups(model, train)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.beta1)
    betas = (train.beta1, train.beta2)
    if all(p.is_cuda for g in groups for p in g["params"]) and any(g["params"] for g in groups):
        # On CUDA the fused kernel: the single-tensor loop launches a dozen small kernels per
        # parameter, which a GPU step waits on (host-bound); fused holds no temporaries either.
        return torch.optim.AdamW(groups, lr=train.lr, betas=betas, fused=True)
    # Single-tensor kernels: what plan's CPU memory model counts (two temporaries of the largest tensor).
    return torch.optim.AdamW(groups, lr=train.lr, betas=betas, foreach=False)


def lr_at(step: int, train: TrainConfig) -> float:
    """Linear warmup to train.lr, then cosine decay to train.min_lr at train.steps, from the step
    train.schedule_start (a continued run's schedule re-warms and decays again over its own steps)."""
    step -= train.schedule_start
    if step < train.warmup_steps:
        return train.lr * (max(step, 0) + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.steps - train.schedule_start - train.warmup_steps)
    floor = train.final_lr
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: torch.optim.Optimizer, step: int, train: TrainConfig) -> float:
    """Set the learning rate of `step` (a function of the step: resume needs no scheduler state)."""
    lr = lr_at(step, train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


class BatchSizes(Protocol):
    """train.global_batch and train.micro_batch (a TrainConfig, or plan's Workload)."""

    @property
    def global_batch(self) -> int: ...

    @property
    def micro_batch(self) -> int: ...


def micro_batching(train: BatchSizes, data_parallel: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) that keep train.global_batch fixed over `data_parallel`
    replicas: the largest micro-batch up to train.micro_batch that divides each replica's share."""
    g = train.global_batch
    if g % data_parallel:
        raise ConfigError(f"train.global_batch {g} is not divisible by {data_parallel} workers")
    per_rank = g // data_parallel
    micro = max(m for m in range(1, min(train.micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


def autocast(train: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for train.precision bf16-mixed, else nothing."""
    import torch

    if train.precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batch_loss(loss_fn, model: torch.nn.Module, tokens: torch.Tensor, accumulation: int, amp) -> torch.Tensor:
    """One micro-batch's share of the step's loss (its gradient sums to the global batch's mean)."""
    with amp:
        return loss_fn(model, tokens) / accumulation


def clip_gradients(model: torch.nn.Module, clip: float) -> torch.Tensor:
    """The global gradient norm (identical on every rank), clipping to `clip` if it is set; a tensor
    on the gradients' device, so that reading it is the caller's choice (a host sync on a GPU)."""
    import torch

    if clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
        norm = norm.full_tensor()
    return norm


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer can drop a step's update by itself, from a flag on the device: the fused
    AdamW/Adam kernels read `optimizer.found_inf` (as `torch.amp.GradScaler` sets it) and leave the
    weights, moments and step counts as they were when it is 1. Not over DTensors (FSDP), whose
    kernels are not known to take a plain tensor beside them."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)  # all alike: FSDP's or not
    return bool(optimizer.defaults.get("fused")) and first is not None and not hasattr(first, "to_local")


def apply_gradients(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train: TrainConfig,
    *,
    before_step=lambda: 0.0,
    clip=None,
) -> tuple[float | torch.Tensor, float]:
    """Clip the accumulated gradients and step the optimizer, unless their global norm is not
    finite: then the update is dropped (`faults.nonfinite` decides what follows). Returns the
    norm and what `before_step()` returned (called just before the update: the loop waits there
    for a live checkpoint snapshot to be read, and gets the seconds it waited). `clip(max_norm)` clips
    where the gradients are not all on this rank (a pipeline's stages).

    Where the optimizer drops an update on the device (`skips_on_device`: fused AdamW on a GPU) the
    norm is returned as a tensor, not read: deciding on the host would wait for the backward pass
    between it and the update, and the GPU would idle while the host launches the optimizer and the
    next forward (3-8 ms a step on an H200, 15% of a 124M model's step). The caller reads it with
    the step's other values, in the one host sync of the step."""
    import torch

    norm = clip(train.grad_clip) if clip is not None else clip_gradients(model, train.grad_clip)
    if isinstance(norm, torch.Tensor) and skips_on_device(optimizer):
        optimizer.found_inf = (~torch.isfinite(norm)).float()  # type: ignore[attr-defined]
        update = True  # the kernel decides
    else:
        norm = float(norm)
        update = math.isfinite(norm)
    waited = before_step() if update else 0.0
    if update:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, waited


def step_flags(loss_sum: torch.Tensor, decisions: tuple[bool, ...]) -> torch.Tensor:
    """The loss and the decisions every rank must share, in one tensor beside the loss, made without a
    copy from the host: `torch.tensor(..., device="cuda")` is a blocking copy, which waits for the
    stream (the whole forward and backward) before the host may launch the update."""
    import torch

    flags = torch.zeros(1 + len(decisions), device=loss_sum.device)
    flags[0] = loss_sum
    for k, decision in enumerate(decisions, 1):
        if decision:
            flags[k] = 1.0  # a fill with a scalar argument: no copy
    return flags


def read_step(flags: torch.Tensor, norm: float | torch.Tensor) -> tuple[list[float], float]:
    """The step's one host read: the values of `flags` (the loss and the decisions the ranks share)
    and the gradient norm, which `apply_gradients` left on the device where the optimizer drops a
    non-finite update by itself."""
    import torch

    if isinstance(norm, torch.Tensor):
        *values, grad_norm = torch.cat([flags, norm.reshape(1).to(flags)]).tolist()
        return values, grad_norm
    return flags.tolist(), norm


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Optimal compute time between checkpoints (Daly 2006, eq. 37; Young 1974 to first order):
    τ = √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else τ = M."""
    d, m = checkpoint_s, mtbf_s
    if d <= 0:
        return 0.0
    if d >= 2 * m:
        return m
    r = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(r) / 3 + r / 9) - d


def checkpoint_interval_s(cost_s: float, mtbf_s: float, write_s: float) -> float:
    """Seconds between checkpoints: Young/Daly for a checkpoint costing `cost_s` of training and
    a job MTBF of `mtbf_s`, but never faster than a write completes (`write_s`)."""
    return max(young_daly_interval(cost_s, mtbf_s), write_s)


class CheckpointSchedule:
    """When `train` checkpoints: every N steps, every S seconds, or the Young/Daly interval.

    For `auto` the cost of one checkpoint is what the training loop loses to it: the stall,
    plus, when the writer's thread competes with the loop for the same cores (training on
    CPU), the CPU time the background write took; on a GPU the write runs on host cores the
    loop does not need. The job fails when any of its `world` ranks' nodes does.
    """

    def __init__(self, cfg: JobConfig, world: int, *, writer_competes: bool = False):
        self.unit, self.value = cfg.checkpoint.interval()
        self.mtbf_s = cfg.faults.mtbf_hours * 3600 / max(1, world)
        self.writer_competes = writer_competes
        self.last_t = time.time()
        self.cost_s: float | None = None
        self.write_s = 0.0

    def due(self, step: int) -> bool:
        if self.unit == "steps":
            return step % int(self.value) == 0
        return time.time() - self.last_t >= self.interval_s()

    def interval_s(self) -> float:
        if self.unit == "seconds":
            return self.value
        if self.cost_s is None:  # auto: take one early checkpoint to measure what it costs
            return 10.0
        return checkpoint_interval_s(max(self.cost_s, 1e-4), self.mtbf_s, self.write_s)

    def taken(self, stall_s: float, write_s: float, write_cpu_s: float = 0.0) -> None:
        """A checkpoint was taken; `write_s`/`write_cpu_s` describe the previous write (the last one finished)."""
        self.last_t = time.time()
        cost = stall_s + (write_cpu_s if self.writer_competes else 0.0)
        self.cost_s = cost if self.cost_s is None else 0.8 * self.cost_s + 0.2 * cost
        self.write_s = write_s
