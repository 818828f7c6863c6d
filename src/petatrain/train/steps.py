"""How one training step runs on a rank: what the strategy wrapped, and how its forward, backward,
gradient clip, evaluation and final weights go. `MicroBatches` is DDP's and FSDP's (gradient
accumulation over micro-batches, the wrapper reducing); `PipelineSteps` runs a pipeline schedule.
The loop (train/loop.py) calls one or the other through the same five methods."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from petatrain.cost import formulas
from petatrain.models import ModelSpec
from petatrain.models.tensor_parallel import in_unsplit_order, split_of
from petatrain.train import recipe, trace

NextBatch = Callable[[], torch.Tensor]


@dataclass
class MicroBatches:
    """`accumulation` micro-batches a step; the wrapped model (DDP, FSDP) reduces the gradients."""

    model: nn.Module
    spec: ModelSpec
    accumulation: int
    world: int

    @property
    def loss_share(self) -> int:
        """The step's loss is the sum over ranks of `forward_backward`'s, divided by this."""
        return self.world

    def forward_backward(self, next_batch: NextBatch, amp: Any, *, poison: bool = False) -> torch.Tensor:
        """Gradients of the step's micro-batches, accumulated (DDP reduces on the last one only);
        the step's loss on this rank. `poison`: an injected `nan` makes it NaN."""
        device = next(self.model.parameters()).device
        loss_sum = torch.zeros((), device=device)
        for m in range(self.accumulation):
            tokens = next_batch().to(device, non_blocking=True)
            no_sync = getattr(self.model, "no_sync", None)  # DDP's: gradients all-reduced on the last micro-batch only
            with contextlib.nullcontext() if m == self.accumulation - 1 or no_sync is None else no_sync():
                loss = recipe.micro_batch_loss(self.spec.loss_fn, self.model, tokens, self.accumulation, amp)
            if poison:
                loss = loss * float("nan")
            loss.backward()
            loss_sum += local(loss.detach()).float()
        return loss_sum

    def clip(self, max_norm: float) -> torch.Tensor:
        return recipe.clip_gradients(self.model, max_norm)

    def eval_loss(self, tokens: torch.Tensor, amp: Any) -> torch.Tensor | None:
        """The loss of one held-out batch, where this rank computes one."""
        with amp:
            return self.spec.loss_fn(self.model, tokens).float()

    def stage_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any] | None:
        """A pipeline rank's compute and memory since the last report (the `pipeline_stage` event); None here."""
        return None

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (a collective), empty elsewhere."""
        return full_model_state(self.model)


@dataclass
class TensorSteps(MicroBatches):
    """MicroBatches on a tensor-parallel model (train/strategies/tensor.py): the loss over
    vocabulary-sharded logits (torch's loss_parallel) where the model's plan says so, and the final
    weights whole in the unsplit layout. Every rank of a group reports its replica's loss (loss_share)."""

    loss_parallel: bool = False

    def loss_context(self) -> Any:
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @property
    def fused(self) -> dict[str, int]:
        return split_of(self.model)[0]

    def forward_backward(self, next_batch: NextBatch, amp: Any, *, poison: bool = False) -> torch.Tensor:
        with self.loss_context():
            return super().forward_backward(next_batch, amp, poison=poison)

    def eval_loss(self, tokens: torch.Tensor, amp: Any) -> torch.Tensor | None:
        with self.loss_context():
            loss = super().eval_loss(tokens, amp)
        return local(loss) if loss is not None else None

    def full_state(self) -> dict[str, torch.Tensor]:
        return in_unsplit_order(self.model, super().full_state())


@dataclass
class PipelineSteps:
    """One schedule step over this replica's batch; gradients reduced and clipped over the pipeline."""

    piped: Any  # train.pipeline.stages.PipelineRank
    schedule: str
    predicted_step_busy_s: float | None = None  # this rank's compute per step, from a layer profile
    predicted_state_bytes: int | None = None  # weights, gradients, optimizer state of its parts (profile)
    predicted_activation_bytes: int | None = None  # peak activations its schedule holds (profile)
    reported: int = 0
    reduce_s: float = 0.0  # in reduce_gradients since the last stage report (the data-parallel dimension)

    @property
    def model(self) -> nn.Module:
        return self.piped.model

    @property
    def fused(self) -> dict[str, int]:
        """Tensor parallelism: the parameters a FusedColwise split holds in its own row order."""
        return split_of(self.model)[0]

    @property
    def loss_share(self) -> int:
        layout = self.piped.layout
        return layout.replicas * layout.tensor  # only the ranks of the last part report a loss (each of its group)

    def forward_backward(self, next_batch: NextBatch, amp: Any, *, poison: bool = False) -> torch.Tensor:
        device = next(self.model.parameters()).device
        tokens = next_batch().to(device, non_blocking=True)
        with amp, trace.span("petatrain.schedule"):
            loss = self.piped.forward_backward(tokens)
        t0 = time.perf_counter()
        with trace.span("petatrain.reduce_gradients"):
            self.piped.reduce_gradients()
        self.reduce_s += time.perf_counter() - t0
        if poison:  # the gradients too: the update is dropped as for any non-finite step
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(math.nan)
            loss = loss * float("nan")
        return loss

    def clip(self, max_norm: float) -> float:
        return self.piped.clip(max_norm)

    def eval_loss(self, tokens: torch.Tensor, amp: Any) -> torch.Tensor | None:
        if tokens.size(0) % self.piped.microbatches:
            return None  # a short last batch: uneven micro-batches would hang the next stage (every rank skips it)
        with amp:
            loss = self.piped.forward_backward(tokens, train=False)
        return loss if self.piped.last else None

    def stage_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any] | None:
        """This rank's compute and memory since the last report, from the first replica's ranks (one
        per stage)."""
        from petatrain.train.pipeline.memory import state_bytes

        piped, layout = self.piped, self.piped.layout
        steps, busy, wall, activations = piped.take_window()
        reduce_s, self.reduce_s = self.reduce_s, 0.0
        device = next(self.model.parameters()).device
        device_peak = None
        if device.type == "cuda":
            device_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if steps == 0 or layout.dp_rank(piped.rank) != 0:
            return None
        warm_up, self.reported = self.reported == 0, self.reported + 1
        units = []
        for part in piped.parts:
            span = list(piped.plan.units(part))
            units.append(f"{_unit_name(span[0], piped.plan.n_blocks)}..{_unit_name(span[-1], piped.plan.n_blocks)}")
        predicted = self.predicted_step_busy_s * steps if self.predicted_step_busy_s is not None else None
        return {
            "rank": piped.rank, "parts": piped.parts, "units": units, "steps": steps, "busy_s": busy, "wall_s": wall,
            "schedule": self.schedule, "stages": layout.stages, "microbatches": piped.microbatches,
            "chunks": layout.chunks, "predicted_busy_s": predicted,
            "bubble_theory": formulas.bubble_fraction(layout.stages, piped.microbatches, layout.chunks),
            "param_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "state_bytes": state_bytes(self.model, optimizer), "activation_bytes": activations or None,
            "device_peak_bytes": device_peak, "predicted_state_bytes": self.predicted_state_bytes,
            "predicted_activation_bytes": self.predicted_activation_bytes,
            "warm_up": warm_up, "reduce_s": reduce_s,
        }  # fmt: skip

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every part's weights gathered on rank 0 (from the first replica), by the whole model's names."""
        from petatrain.train.pipeline.stages import gather_full

        layout, rank = self.piped.layout, dist.get_rank()
        first = layout.dp_rank(rank) == 0 and layout.tp_rank(rank) == 0
        # data fsdp, tensor parallelism: a collective over the stage's replicas and its tensor group
        whole = gather_full(self.model.state_dict(), keep=first)
        mine = {k: v.contiguous() for k, v in in_unsplit_order(self.model, whole).items()} if first else {}
        gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part or {})
        return full


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value on this rank (a tensor-parallel loss), or the tensor itself."""
    return cast("torch.Tensor", tensor.to_local()) if hasattr(tensor, "to_local") else tensor


def _unit_name(unit: int, n_blocks: int) -> str:
    return "first" if unit == 0 else "last" if unit == n_blocks + 1 else f"block.{unit - 1}"


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, unsharded weights on rank 0 (a collective for FSDP); separate CPU tensors."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # A model's state dict holds only tensors (full, here); DCP types its values as any state.
    sd = cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=options))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in sd.items()}
