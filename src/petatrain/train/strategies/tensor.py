"""Tensor parallelism (Megatron's column / row split, with sequence parallelism) on DTensor, and
its composition with data parallelism: `parallel.tensor: N` ranks split each layer, and the
`workers / N` groups of them are replicas under `parallel.strategy` ddp (gradients all-reduced
over the replicas) or fsdp (each group's shards sharded again over the replicas: 2D).

The ranks lie on one DeviceMesh ("data", "tensor") with the tensor dimension innermost, as
torchtitan lays it: a tensor-parallel group is `parallel.tensor` consecutive ranks, which Ray
places on one node first. The model says how it splits (`ModelSpec.tensor`, a
`models.tensor_parallel.TensorPlan`); nothing here writes a collective of its own.

Checkpoint: whole tensors by parameter name on rank 0 (gathered, a collective), in the unsplit
model's layout (a fused q|k|v put back in its order), so a checkpoint written at any degree loads
at any other and under DDP, FSDP or a pipeline, and one of theirs loads here (`BY_NAME`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from petatrain.errors import ConfigError
from petatrain.train.strategies.base import (
    ReadRankFile,
    SavedState,
    StateDicts,
    StateLayout,
    Strategy,
    load_by_name,
    read_by_name,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec

DATA = ("ddp", "fsdp")  # what the replicas of a tensor-parallel group may run


class Tensor(Strategy):
    """`Tensor(degree, data)`: `degree`-way tensor parallelism x count / degree replicas under `data`
    (what `plan` searches). The registry's instance (degree 0) trains: it reads the degree and the
    replicas' strategy from the config (`parallel.tensor`, `parallel.strategy`)."""

    name = "tensor"
    trainable = True

    def __init__(self, degree: int = 0, data: str = "ddp"):
        self.degree, self.data = degree, data

    # --- plan -------------------------------------------------------------------------------
    def data_parallel(self, count: int) -> int:
        return max(1, count // self.degree) if self.degree else count

    def infeasible(self, w: Workload, count: int) -> str:
        t = self.degree
        if not t:
            return "plan searches the tensor-parallel degree (2, 4, 8 within a node)"
        if count % t:
            return f"{count} devices are not a multiple of tensor-parallel degree {t}"
        return tensor_split_problem(w, t)

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        """Every matmul's weights, gradients and optimizer state split t ways (the norms' and the
        positions', a rounding error, counted whole too); FSDP replicas split them again D ways and
        hold one block gathered (and the next prefetched) and its gradient before reduce-scatter."""
        from petatrain.train.strategies.base import autocast_copies
        from petatrain.train.strategies.ddp import BUCKET_BYTES

        t = self.degree
        d = count // t
        shards = d if self.data == "fsdp" and d > 1 else 1
        P, unit = w.params / t, w.layer_params / t
        if shards > 1:
            buffers = 2 * unit * w.gathered_width + unit * w.grad_width
        else:
            buckets = min(2 * BUCKET_BYTES, w.grad_width * P) if d > 1 else 0.0  # DDP's, over this rank's share
            buffers = autocast_copies(w, w.n_layer) / t + buckets
        return StateLayout(
            weights=w.weight_width * P / shards,
            gradients=w.grad_width * P / shards,
            optimizer=w.optimizer_width * P / shards,
            buffers=buffers,
            stage_layers=w.n_layer,
            grad_shards=t * shards,
            optimizer_shards=t * shards,
            activation_shards=t,
        )

    def communication_s(
        self,
        w: Workload,
        count: int,
        *,
        compute_s: float,
        accumulation: int,
        bandwidth: float,
        intra_bandwidth: float = 0.0,
    ) -> tuple[float, float]:
        """The tensor-parallel collectives of every layer, inside the node and not hidden (nothing
        overlaps them here), plus the replicas' gradient traffic over 1/t of the model: DDP's
        all-reduce after backward, or FSDP's gathers and reduce-scatter per micro-batch."""
        from petatrain.train.strategies.ddp import allreduce_exposed_s
        from petatrain.train.strategies.fsdp import sharded_exposed_s

        t = self.degree
        d, share = count // t, w.params / t  # replicas, and the parameters each rank of a group holds
        tp = tensor_exposed_s(w, t, w.n_layer, accumulation, intra_bandwidth or bandwidth)
        if self.data == "fsdp" and d > 1:
            dp = sharded_exposed_s(w, d, share, compute_s=compute_s, accumulation=accumulation, bandwidth=bandwidth)
        else:
            dp = allreduce_exposed_s(w, d, compute_s=compute_s, bandwidth=bandwidth, params=share)
        return tp + dp, 0.0

    def checkpoint_bytes_per_device(self, total: float, count: int) -> float:
        return total / self.degree if self.degree else total

    # --- train ------------------------------------------------------------------------------
    def check_config(self, cfg: JobConfig) -> None:
        degree, data = cfg.parallel.tensor, cfg.parallel.strategy
        if data not in DATA:  # a pipeline's stages split by tensor parallelism are the pipeline strategy's
            raise ConfigError(
                f"parallel.tensor {degree} with parallel.strategy {data}: tensor-parallel groups are replicated "
                f"by {' or '.join(DATA)}, or are the stages of a pipeline"
            )
        plan = builtin_plan(cfg)
        problem = plan.problem(degree) if plan is not None else ""
        if problem:
            raise ConfigError(problem)

    def rng_rank(self, cfg: JobConfig, rank: int) -> int:
        """A tensor-parallel group draws one dropout stream: the activations it keeps whole (the
        embedding's) must be dropped alike on each of its ranks."""
        return rank // cfg.parallel.tensor

    def wrap(self, spec: ModelSpec, cfg: JobConfig, device: torch.device) -> nn.Module:
        return self.steps(spec, cfg, device, 0).model

    def steps(self, spec: ModelSpec, cfg: JobConfig, device: torch.device, world: int) -> Any:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from petatrain.models import tied_names
        from petatrain.models.tensor_parallel import mark_split
        from petatrain.train import recipe
        from petatrain.train.steps import TensorSteps

        degree, world = cfg.parallel.tensor, dist.get_world_size()
        plan = spec.tensor
        if plan is None:
            raise ConfigError(
                f"model.kind {cfg.model.kind}: parallel.tensor needs a model that declares its tensor-parallel plan "
                "(return a TensorPlan from the factory)"
            )
        if plan.problem(degree):
            raise ConfigError(plan.problem(degree))
        replicas = world // degree
        if device.type == "cuda":
            _check_groups_within_nodes(degree, world)
        mesh = init_device_mesh(device.type, (replicas, degree), mesh_dim_names=("data", "tensor"))
        model = spec.module.to(device)
        ties = tied_names(model)
        fused = plan.fused(model, degree)
        parallelize_module(model, mesh["tensor"], plan.styles(degree))
        _tie_again(model, ties)
        if replicas > 1:
            _replicate(model, spec, cfg, mesh["data"])
        mark_split(model, fused, degree)
        _, accumulation = recipe.micro_batching(cfg.train, replicas)
        return TensorSteps(model, spec, accumulation, world, loss_parallel=plan.loss_parallel)

    def data_shard(self, cfg: JobConfig, rank: int, world: int) -> tuple[int, int, int]:
        """The ranks of a tensor-parallel group read the same rows: its replica's share of the batch."""
        from petatrain.train import recipe

        degree = cfg.parallel.tensor
        micro, _ = recipe.micro_batching(cfg.train, world // degree)
        return rank // degree, world // degree, micro

    def saves_model(self, rank: int, cfg: JobConfig | None = None) -> bool:
        return rank == 0

    def state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: int,
        cfg: JobConfig,
        kept: StateDicts | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Whole tensors on rank 0, in the unsplit model's layout (a collective on every rank, each
        snapshot: `kept` is not used)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from petatrain.models.tensor_parallel import in_unsplit_order

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = cast("dict[str, Any]", get_optimizer_state_dict(model, optimizer, options=options))
        if rank != 0:  # torch gathers onto rank 0 only
            return {}, {"state": {}, "param_groups": []}
        state = in_unsplit_order(model, optim_sd["state"])
        return in_unsplit_order(model, model_sd), {"state": state, "param_groups": optim_sd["param_groups"]}

    def read_for_resume(
        self, state: SavedState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every file of the checkpoint merged into whole tensors by name (any strategy, any degree)."""
        from petatrain.models import tied_names

        return read_by_name(state, read, rank=rank, world=world, ties=tied_names(model))

    def load_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: SavedState,
        shards: dict[int, dict[str, torch.Tensor]],
        *,
        rank: int,
    ) -> None:
        from petatrain.models import tied_names

        load_by_name(model, optimizer, state, permute_fused(model, shards[0]), tied_names(model))


def permute_fused(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors by flat name (model/FQN, optim/FQN/KEY) with each fused one's rows in the order
    `model`'s FusedColwise split holds them (`in_unsplit_order`'s inverse; the others as they are)."""
    from petatrain.models.tensor_parallel import permuted, split_of
    from petatrain.train.checkpoint.tensors import split_name

    fused, degree = split_of(model)
    if not fused:
        return tensors
    out = dict(tensors)
    for name, tensor in tensors.items():
        _, fqn, _ = split_name(name)
        if fqn in fused and tensor.dim() > 0:
            out[name] = permuted(tensor, fused[fqn], degree)
    return out


def tensor_split_problem(w: Workload, degree: int) -> str:
    """Why the GPT of workload `w` cannot be split `degree` ways ("" if it can): the sizes its plan splits."""
    for what, size in (("n_head", w.n_head), ("d_ff", w.d_ff), ("vocab_size", w.vocab_size), ("seq_len", w.seq_len)):
        if size % degree:
            return f"model.{what} {size} is not divisible by tensor-parallel degree {degree}"
    return ""


def tensor_exposed_s(w: Workload, degree: int, layers: int, accumulation: int, bandwidth: float) -> float:
    """Seconds of tensor-parallel collectives a step waits for, per rank: for each layer and micro-batch,
    Megatron's two in forward and two in backward (with sequence parallelism an all-gather and a
    reduce-scatter each, the volume of an all-reduce), two more where full recompute repeats the
    forward; and the embedding's and the head's pair. Each moves one micro-batch's activations (b s h)."""
    from petatrain.cost import formulas

    if degree <= 1:
        return 0.0
    act = w.micro_batch * w.seq_len * w.d_model * w.activation_bytes_per_element
    per_layer = 4 + (2 if w.recompute == "full" else 0)
    once = formulas.ring_allreduce_seconds(act, degree, bandwidth)
    return accumulation * (layers * per_layer + 2) * once


def builtin_plan(cfg: JobConfig) -> Any:
    """The built-in model's TensorPlan (checked before workers start), None for a user model (checked
    where it is built) or a model without one."""
    if cfg.model.kind == "gpt":
        from petatrain.models.gpt import gpt_tensor_plan

        return gpt_tensor_plan(cfg.model)
    if cfg.model.kind == "mlp":
        raise ConfigError("model.kind mlp has no tensor-parallel plan (parallel.tensor trains the gpt or a user model)")
    return None


def _check_groups_within_nodes(degree: int, world: int) -> None:
    """On GPUs a tensor-parallel group's collectives run every layer: over NVLink inside a node, not
    the network. Ray Train numbers a node's workers consecutively, so each group of `degree`
    consecutive ranks must find one host (a collective on every rank)."""
    import socket

    import torch.distributed as dist

    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    for first in range(0, world, degree):
        group = hosts[first : first + degree]
        if len(set(group)) > 1:
            raise ConfigError(
                f"parallel.tensor {degree}: ranks {first}-{first + degree - 1} are on {len(set(group))} nodes "
                f"({', '.join(sorted(set(group)))}); a tensor-parallel group must fit one node's GPUs"
            )


def _tie_again(model: nn.Module, ties: list[list[str]]) -> None:
    """parallelize_module gives each module its own DTensor parameter: tied names (the GPT's
    embedding and head, both split by vocabulary) share the first one's again."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            other = model.get_parameter(name)
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise ConfigError(
                    f"{names[0]} and {name} are one tensor, but the tensor-parallel plan splits them differently "
                    f"({getattr(first, 'placements', None)} and {getattr(other, 'placements', None)})"
                )
            setattr(model.get_submodule(owner), attr, first)


def _replicate(model: nn.Module, spec: ModelSpec, cfg: JobConfig, mesh: Any) -> None:
    """The tensor-parallel groups as data-parallel replicas over `mesh` (the data dimension):
    FSDP2 shards each block again (2D), DDP's replication through FSDP2's `replicate`."""
    from torch.distributed.fsdp import fully_shard

    from petatrain.train.strategies.fsdp import precision_policy

    policy = precision_policy(cfg)
    if cfg.parallel.strategy == "fsdp":
        for module in model.modules():
            if spec.block_types and isinstance(module, spec.block_types):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(model, mesh=mesh, mp_policy=policy)
