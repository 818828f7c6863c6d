"""What a parallelism strategy is: how `train` wraps the model and lays out its checkpoint, and
how `plan` estimates its memory and communication.

A strategy `plan` models but `train` does not run yet (zero1, zero2, pipeline) keeps the
training methods of this base class, which refuse it in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from petatrain.errors import ConfigError

if TYPE_CHECKING:  # plan imports the registry and must not pay for torch
    import torch
    from torch import nn

    from petatrain.config import JobConfig
    from petatrain.cost.workload import Workload
    from petatrain.models import ModelSpec

# Share of the backward (DDP, ZeRO) or forward+backward (FSDP) compute that hides communication.
OVERLAP = 0.8

ReadRankFile = Callable[[int], "dict[str, torch.Tensor]"]  # rank -> its checkpoint file's tensors, verified


class SavedState(Protocol):
    """What a strategy reads of a checkpoint's record (`train.checkpoint.CheckpointState`)."""

    @property
    def world_size(self) -> int: ...

    @property
    def strategy(self) -> str: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class StateLayout:
    """One device's share of the model states, and what else lives through forward and backward."""

    weights: float  # bytes
    gradients: float
    optimizer: float
    buffers: float  # gathered blocks, gradient buckets, autocast's weight copies
    stage_layers: int  # layers this device runs
    in_flight: int = 1  # micro-batches whose activations it holds at once
    grad_shards: int = 1  # one block's gradient is split this many ways
    optimizer_shards: int = 1  # the optimizer's (GPU, foreach) temporary is split this many ways
    activation_shards: int = 1  # tensor (and sequence) parallelism splits every activation this many ways


class Strategy:
    """One way to spread training over `count` devices (a subclass per file, one instance in the registry)."""

    name: ClassVar[str]
    trainable: ClassVar[bool] = False  # `train` runs it (else `plan` models it only)
    every_rank_writes: ClassVar[bool] = False  # each rank's checkpoint file holds its own model state

    # --- plan -------------------------------------------------------------------------------
    def data_parallel(self, count: int) -> int:
        """Replicas the global batch is split over."""
        return count

    def infeasible(self, w: Workload, count: int) -> str:
        """Why `count` devices cannot run this workload ("" if they can), besides the batch not dividing."""
        return ""

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        raise NotImplementedError

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
        """(exposed communication, pipeline bubble) of one step, in seconds. `bandwidth`: the slowest
        link the data-parallel collectives cross; `intra_bandwidth`: a node's own (NVLink), which
        tensor-parallel groups stay within."""
        raise NotImplementedError

    def checkpoint_bytes_per_device(self, total: float, count: int) -> float:
        """What one device snapshots of a checkpoint of `total` bytes."""
        return total / count

    # --- train ------------------------------------------------------------------------------
    def require_trainable(self) -> None:
        """One-line ConfigError unless `train` runs this strategy (the driver checks before starting workers)."""
        if not self.trainable:
            from petatrain.train.strategies import TRAINABLE

            raise ConfigError(
                f"parallel.strategy {self.name!r}: train runs {' or '.join(TRAINABLE)} "
                f"({self.name} is modelled by `petatrain plan` only)"
            )

    def check_config(self, cfg: JobConfig) -> None:
        """One-line ConfigError for a config this strategy cannot train (the driver checks before starting workers)."""
        self.require_trainable()

    def wrap(self, spec: ModelSpec, cfg: JobConfig, device: torch.device) -> nn.Module:
        """The model on `device`, wrapped for this strategy (train)."""
        self.require_trainable()
        raise NotImplementedError

    def steps(self, spec: ModelSpec, cfg: JobConfig, device: torch.device, world: int) -> Any:
        """How a step runs on this rank (train/steps.py): the wrapped model and gradient accumulation."""
        from petatrain.train import recipe
        from petatrain.train.steps import MicroBatches

        _, accumulation = recipe.micro_batching(cfg.train, world)
        return MicroBatches(self.wrap(spec, cfg, device), spec, accumulation, world)

    def rng_rank(self, cfg: JobConfig, rank: int) -> int:
        """Which dropout stream `rank` draws (ranks that must drop the same activations share one)."""
        return rank

    def data_shard(self, cfg: JobConfig, rank: int, world: int) -> tuple[int, int, int]:
        """(loader rank, loader world, rows per `next()`) of this rank's data."""
        from petatrain.train import recipe

        micro, _ = recipe.micro_batching(cfg.train, world)
        return rank, world, micro

    def saves_model(self, rank: int, cfg: JobConfig | None = None) -> bool:
        """Whether `rank`'s checkpoint file holds model and optimizer tensors."""
        return True

    def state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: int,
        cfg: JobConfig,
        kept: StateDicts | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state dicts, by parameter name, of what `rank` saves (a collective where
        a strategy gathers shards); `kept`: the ones the rank's earlier snapshots took, where they hold."""
        if kept is not None and not any(hasattr(p, "to_local") for p in model.parameters()):
            return kept.get(model, optimizer)
        return torch_state_dicts(model, optimizer)

    def read_for_resume(
        self, state: SavedState, read: ReadRankFile, *, model: nn.Module, rank: int, world: int
    ) -> dict[int, dict[str, torch.Tensor]]:
        """The tensors `rank` loads from the checkpoint `state`, by rank file."""
        raise NotImplementedError

    def load_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: SavedState,
        shards: dict[int, dict[str, torch.Tensor]],
        *,
        rank: int,
    ) -> None:
        """Restore model and optimizer from what `read_for_resume` gave."""
        raise NotImplementedError


def torch_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's state dicts of a module and its optimizer, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(model), cast("dict[str, Any]", get_optimizer_state_dict(model, optimizer))


class StateDicts:
    """`get_model_state_dict` and `get_optimizer_state_dict` of a module whose parameters are plain
    tensors (not FSDP's DTensors, whose state dicts are taken through FSDP's hooks each time), kept
    from one snapshot to the next: their generic machinery (names resolved through
    every wrapper, for every parameter) took 33 ms of a snapshot's stall for a 24-layer GPT here,
    more than the copy itself on a GPU. The kept dicts hold the very tensors the module and the
    optimizer update in place, so they stay current; they are taken again when any of those objects
    is not the same one (the optimizer's state loaded or first made, a parameter replaced), and the
    optimizer's param_groups (the learning rate) are read every time."""

    def __init__(self) -> None:
        self._sources: list[Any] = []  # what the kept dicts stand for, held
        self._model_sd: dict[str, Any] = {}
        self._state: dict[str, Any] = {}
        self._names: list[list[str]] = []  # each param group's parameter names

    def get(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        sources = self._sources_of(model, optimizer)
        if len(sources) != len(self._sources) or any(a is not b for a, b in zip(sources, self._sources, strict=True)):
            self._model_sd, optim_sd = torch_state_dicts(model, optimizer)
            self._state = dict(optim_sd["state"])
            self._names = [list(g["params"]) for g in optim_sd["param_groups"]]
            self._sources = sources
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(optimizer.param_groups, self._names, strict=True)
        ]
        return dict(self._model_sd), {"state": dict(self._state), "param_groups": groups}

    @staticmethod
    def _sources_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
        """Every object the kept dicts stand for: the module's parameters and buffers, the optimizer's
        parameters, their state dicts and each tensor in them."""
        sources: list[Any] = [*model.parameters(), *model.buffers()]
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                sources.append(p)
                if state is not None:
                    sources.append(state)
                    sources.extend(state.values())
        return sources


def autocast_copies(w: Workload, layers: int) -> float:
    """bf16 copies of the matmul weights of `layers` layers that autocast keeps for backward."""
    return 2 * w.matmul_params * (layers / w.n_layer) if w.precision == "bf16-mixed" else 0.0


# Strategies a run of any of them resumes from: DDP's and a pipeline's checkpoints hold whole
# tensors by parameter name (DDP: rank 0 all of them; a pipeline: each part's rank its own), FSDP's
# rows of them in rank order, which `read_by_name` puts back together.
BY_NAME = ("ddp", "pipeline", "fsdp", "tensor")


def read_by_name(
    state: SavedState, read: ReadRankFile, *, rank: int, world: int, ties: list[list[str]]
) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank file's model and optimizer tensors merged into whole tensors under 0 (whatever
    strategy and shape wrote them); this rank's own RNG under `rank` at an unchanged world size.
    `ties`: the model's tied names (an FSDP checkpoint holds each under every name)."""
    import torch

    from petatrain.train.checkpoint.tensors import split_name

    # FSDP's files: each a dim-0 chunk of every parameter (under each of its names) and its
    # optimizer state, in rank order; buffers whole in every file
    sharded: set[str] = set()
    if state.strategy == "fsdp":
        sharded = {fqn for group in state.param_groups for fqn in group["params"]}
        sharded |= {n for names in ties if sharded & set(names) for n in names}
    merged: dict[str, torch.Tensor] = {}
    rows: dict[str, list[torch.Tensor]] = {}
    own: dict[str, torch.Tensor] = {}
    for r in range(state.world_size):
        for name, tensor in read(r).items():
            kind, fqn, _ = split_name(name)
            if kind == "rng":
                if r == rank and state.world_size == world:
                    own[name] = tensor
            elif fqn in sharded and tensor.dim() > 0:
                rows.setdefault(name, []).append(tensor)
            else:
                merged[name] = tensor
    merged.update({name: torch.cat(chunks) for name, chunks in rows.items()})
    return {0: merged, rank: {**merged, **own}} if own else {0: merged}


def alias_ties(model_sd: dict[str, Any], optim_state: dict[str, Any], ties: list[list[str]]) -> None:
    """A weight tied under several names (`ties`) may be saved under any of them (DDP keeps one
    optimizer state for the GPT's embedding and head, a pipeline one per stage that holds it): fill
    in the others, in place."""
    for names in ties:
        for saved in (model_sd, optim_state):
            found = next((n for n in names if n in saved), None)
            for n in names:
                if found is not None and n not in saved:
                    saved[n] = saved[found]


def this_models_groups(model: nn.Module, optimizer: torch.optim.Optimizer, state: SavedState) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with the checkpoint's hyper-parameters: the parameters
    are this rank's own (a pipeline's rank 0 recorded only its stage's)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from petatrain.errors import CorruptDataError

    current = cast("list[dict[str, Any]]", get_optimizer_state_dict(model, optimizer)["param_groups"])
    if len(current) != len(state.param_groups):
        raise CorruptDataError(
            f"the checkpoint has {len(state.param_groups)} optimizer groups, this optimizer {len(current)}"
        )
    return [{**saved, "params": group["params"]} for group, saved in zip(current, state.param_groups, strict=True)]


def load_by_name(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: SavedState,
    tensors: dict[str, torch.Tensor],
    ties: list[list[str]],
) -> None:
    """The parameters `model` holds and their optimizer state, by name, from `tensors` (model/FQN,
    optim/FQN/KEY, whole tensors); the optimizer's groups are this model's own with the saved
    hyper-parameters; tied weights as `alias_ties`."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from petatrain.errors import CorruptDataError
    from petatrain.train.checkpoint.tensors import unflatten_state

    model_sd, optim_state = unflatten_state(tensors)
    alias_ties(model_sd, optim_state, ties)
    wanted = get_model_state_dict(model)
    missing = sorted(set(wanted) - set(model_sd))
    if missing:
        raise CorruptDataError(f"the checkpoint holds no tensor for {', '.join(missing[:3])}")
    # A sharded model (a pipeline's stages under FSDP) takes the whole tensors and keeps its rows of them.
    options = StateDictOptions(full_state_dict=any(hasattr(v, "to_local") for v in wanted.values()))
    set_model_state_dict(model, cast("dict[str, Any]", {k: model_sd[k] for k in wanted}), options=options)
    groups = this_models_groups(model, optimizer, state)
    mine = {fqn: optim_state[fqn] for group in groups for fqn in group["params"] if fqn in optim_state}
    set_optimizer_state_dict(model, optimizer, cast("Any", {"state": mine, "param_groups": groups}), options=options)
