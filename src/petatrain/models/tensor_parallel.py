"""How a model declares its tensor-parallel plan: `torch.distributed.tensor.parallel` styles by
module name (Megatron's column / row split, sequence parallelism for the norms, a
vocabulary-parallel embedding and head), plus the two styles torch does not have:

- `FusedColwise(groups)`: a column split of a Linear whose output is `groups` tensors side by side
  (the GPT's fused q|k|v). Each rank holds its columns of every group, so its local output is its
  heads' q, k and v; `canonical` / `permuted` map the sharded parameter's rows to and from the
  unsplit model's order, which is what checkpoints hold.
- `Replicated()`: a module kept whole on every rank of the group (a position table), its
  parameters Replicate DTensors so that every parameter of the model is a DTensor of one mesh.

A model gives `TensorPlan(styles=..., divisible=...)`: `styles(tp)` the plan for parallelize_module,
`divisible` the sizes that must divide by the degree (heads, hidden width, vocabulary), each
named for the one-line error.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


@dataclass(frozen=True)
class TensorPlan:
    """`styles(degree)`: module name (fnmatch patterns, as parallelize_module takes) -> ParallelStyle;
    `divisible`: what must divide by the degree, e.g. {"model.n_head": 12}; `loss_parallel`: the loss
    takes vocabulary-sharded logits (the head's output stays a DTensor sharded on its last dim)."""

    styles: Callable[[int], dict[str, ParallelStyle]]
    divisible: dict[str, int] = field(default_factory=dict)
    loss_parallel: bool = False

    def problem(self, degree: int) -> str:
        """Why `degree` ranks cannot split this model ("" if they can)."""
        for what, size in self.divisible.items():
            if size % degree:
                return f"{what} {size} is not divisible by parallel.tensor {degree}"
        return ""

    def fused(self, model: nn.Module, degree: int) -> dict[str, int]:
        """parameter name -> groups, for every parameter a FusedColwise style splits."""
        out: dict[str, int] = {}
        for pattern, style in self.styles(degree).items():
            if not isinstance(style, FusedColwise):
                continue
            for name, module in model.named_modules():
                if fnmatch.fnmatchcase(name, pattern):
                    out.update({f"{name}.{p}": style.groups for p, _ in module.named_parameters()})
        return out


class FusedColwise(ColwiseParallel):
    """A column split of a Linear whose output rows are `groups` equal tensors (q|k|v): rank r holds
    the r-th slice of each group, concatenated. The DTensor's global rows are then in `permuted`
    order, not the unsplit module's."""

    def __init__(self, groups: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.groups = groups

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        degree, rank = device_mesh.size(), device_mesh.get_local_rank()
        for p_name, param in module.named_parameters():
            local = _rank_rows(param.detach(), self.groups, degree, rank)
            dist = DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False)
            module.register_parameter(p_name, nn.Parameter(dist, requires_grad=param.requires_grad))


class Replicated(ParallelStyle):
    """The module whole on every rank: parameters Replicate DTensors, inputs and outputs plain."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partial(_replicate_params),
            input_fn=_inputs_replicated,  # type: ignore[arg-type]  # torch types it as returning None; it uses the result
            output_fn=_output_local,
        )


def _replicate_params(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    for p_name, param in module.named_parameters(recurse=False):
        dist = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
        module.register_parameter(p_name, nn.Parameter(dist, requires_grad=param.requires_grad))


def _inputs_replicated(module: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
        else t
        for t in inputs
    )


def _output_local(module: nn.Module, output: Any, device_mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _rank_rows(full: torch.Tensor, groups: int, degree: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of a fused tensor: its slice of each of the `groups` groups, in order."""
    return torch.cat([g.chunk(degree)[rank] for g in full.chunk(groups)]).contiguous()


def permuted(full: torch.Tensor, groups: int, degree: int) -> torch.Tensor:
    """The unsplit module's rows in the order a FusedColwise split holds them (rank 0's slices of
    every group, then rank 1's, ...)."""
    return torch.cat([_rank_rows(full, groups, degree, r) for r in range(degree)])


def canonical(held: torch.Tensor, groups: int, degree: int) -> torch.Tensor:
    """`permuted`'s inverse: the unsplit module's rows from a FusedColwise split's global rows."""
    per_rank = held.chunk(degree)  # each: its slice of every group
    slices = [part.chunk(groups) for part in per_rank]  # [rank][group]
    return torch.cat([torch.cat([slices[r][g] for r in range(degree)]) for g in range(groups)])


SPLIT = "petatrain_tensor_split"  # on a model split by tensor parallelism: (fused parameter -> groups, degree)


def mark_split(model: nn.Module, fused: dict[str, int], degree: int) -> None:
    """Record on `model` which of its parameters a FusedColwise split holds in its own row order."""
    setattr(model, SPLIT, (fused, degree))


def split_of(model: nn.Module) -> tuple[dict[str, int], int]:
    """(fused parameter -> groups, degree) of a model `mark_split` marked; ({}, 1) otherwise."""
    return getattr(model, SPLIT, ({}, 1))


def in_unsplit_order(model: nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
    """Parameter FQN -> a tensor, or -> {key: tensor} (an optimizer's state), with each fused one's
    rows in the unsplit module's order (what checkpoints and final weights hold)."""
    fused, degree = split_of(model)
    if not fused:
        return tensors

    def one(fqn: str, value: Any) -> Any:
        if fqn not in fused or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return canonical(value, fused[fqn], degree)

    return {
        fqn: {k: one(fqn, v) for k, v in value.items()} if isinstance(value, dict) else one(fqn, value)
        for fqn, value in tensors.items()
    }
