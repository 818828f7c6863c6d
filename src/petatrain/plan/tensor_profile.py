"""`profile` with `parallel.tensor` > 1: the tensor-parallel collectives of each layer, measured.

The configured model is split as `train` splits it (the tensor strategy: `parallelize_module` with the
model's plan, the head's loss over vocabulary-sharded logits) over `parallel.tensor` processes of this
host (gloo on the CPU, NCCL where the host has that many GPUs, one each). Forward and backward of one
micro-batch run a few times under a dispatch mode that sees every collective DTensor issues, waits
for it and times it, and files it under the modules running it (torch's ModTracker). Per layer:
each collective's kind, count, bytes and seconds, in forward and backward.
In all: the bus bandwidth they achieved (the bytes a ring moves over each rank's link, per second),
which the calibration keeps for `plan`'s tensor-parallel groups on this accelerator; and the
planner's model of the same collectives (`tensor_exposed_s`: Megatron's two all-reduces of a
micro-batch's activations per layer in forward and two in backward, and the embedding's and head's
pair) in bytes against the bytes measured, so a model whose collectives differ shows it.

Each collective is waited for as soon as it is issued: the time is the collective's own, which is
what the planner counts (it overlaps nothing with compute here).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from typing import Any

import torch

from petatrain.config import JobConfig
from petatrain.errors import ConfigError

# The collectives timed (their functional ops' names); the buffer sized is the whole tensor:
# all-reduce's input, all-gather's output, reduce-scatter's and all-to-all's input.
_TIMED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
_LAYER = re.compile(r"\.(blocks|layers|h)\.(\d+)(\.|\s|$)")


def measure(cfg: JobConfig, *, repeats: int = 3) -> dict[str, Any]:
    """The tensor-parallel collectives of one micro-batch's forward and backward, per layer (see above)."""
    from petatrain.train.strategies.tensor import builtin_plan

    degree = cfg.parallel.tensor
    if degree < 2:
        raise ConfigError("profile: the tensor-parallel collectives need parallel.tensor >= 2")
    plan = builtin_plan(cfg)  # shapes that cannot split: one line, before any process (any strategy:
    if plan is not None and plan.problem(degree):  # a pipeline's stages split their layers alike)
        raise ConfigError(plan.problem(degree))
    if why := unavailable(cfg):
        raise ConfigError(f"profile: {why}")
    cuda = torch.cuda.is_available()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="petatrain-tp-profile-") as folder:
        out = os.path.join(folder, "collectives.json")
        args = (degree, f"file://{folder}/store", cfg.to_dict(), repeats, out, cuda)
        mp.start_processes(_rank, args=args, nprocs=degree, start_method="spawn")
        with open(out) as handle:
            records = json.load(handle)
    return summarize(cfg, records, repeats)


def unavailable(cfg: JobConfig) -> str:
    """Why this host cannot measure the collectives ("" if it can): on GPUs, one per rank of the group
    (gloo between CPU processes would calibrate an accelerator's link with the CPU's)."""
    degree = cfg.parallel.tensor
    if torch.cuda.is_available() and torch.cuda.device_count() < degree:
        return f"parallel.tensor {degree} needs {degree} GPUs on this host to measure its collectives; it has " + str(
            torch.cuda.device_count()
        )
    return ""


def summarize(cfg: JobConfig, records: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Per layer and phase: count, bytes and seconds of each collective kind (per micro-batch), the bus
    bandwidth achieved, and the planner's bytes for the same micro-batch against the measured ones."""
    from petatrain.cost import formulas
    from petatrain.cost.workload import Workload
    from petatrain.train.strategies.tensor import tensor_exposed_s

    degree = cfg.parallel.tensor
    layers: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    bus_bytes = seconds = 0.0
    for r in records:
        row = layers.setdefault(r["layer"], {}).setdefault(r["phase"], {})
        kind = row.setdefault(r["op"], {"count": 0, "bytes": 0.0, "seconds": 0.0})
        kind["count"] += 1
        kind["bytes"] += r["bytes"]
        kind["seconds"] += r["seconds"]
        ring = formulas.ring_allreduce_seconds if r["op"] == "all_reduce" else formulas.ring_collective_seconds
        bus_bytes += ring(r["bytes"], degree, 1.0) / repeats  # at 1 byte/s: the bytes over each link
        seconds += r["seconds"] / repeats
    for phases in layers.values():  # per micro-batch: the repeats' mean
        for kinds in phases.values():
            for kind in kinds.values():
                kind["count"], kind["bytes"] = round(kind["count"] / repeats, 6), round(kind["bytes"] / repeats, 3)
                kind["seconds"] /= repeats
    w = Workload.from_config(cfg)
    planned = tensor_exposed_s(w, degree, w.n_layer, 1, 1.0)  # at 1 byte/s: the bytes plan counts
    return {
        "degree": degree,
        "backend": records[0]["backend"] if records else "",
        "micro_batch": w.micro_batch,
        "layers": {name: layers[name] for name in sorted(layers, key=_layer_order)},
        "collectives_per_micro_batch": round(len(records) / repeats),
        "seconds_per_micro_batch": seconds,
        "bus_bytes_per_micro_batch": bus_bytes,
        "bus_bandwidth": bus_bytes / seconds if seconds else 0.0,
        "planned_bus_bytes_per_micro_batch": planned,
        "planned_over_measured_bytes": planned / bus_bytes if bus_bytes else None,
    }


def _layer_order(name: str) -> tuple[int, int, str]:
    match = re.fullmatch(r"layer (\d+)", name)
    return (1, int(match.group(1)), "") if match else ((0 if name == "embedding" else 2), 0, name)


def layer_of(fqn: str) -> str:
    """The layer the modules running (`fqn`: their names, space-separated) belong to: "layer N" for the
    Nth block, else the model's own part by name ("embedding" before the blocks, "head" after them),
    "loss" outside every module (the loss over vocabulary-sharded logits)."""
    if not fqn.strip():
        return "loss"
    match = _LAYER.search(fqn)
    if match:
        return f"layer {int(match.group(2))}"
    lowered = fqn.lower()
    if any(part in lowered for part in ("wte", "wpe", "embed", "tok")):
        return "embedding"
    return "head" if "." in fqn else "model"  # the model's own module, between its parts


def _rank(rank: int, world: int, init: str, config: dict, repeats: int, out: str, cuda: bool) -> None:
    import torch.distributed as dist

    from petatrain import config as config_mod
    from petatrain.models import build_model
    from petatrain.train import strategies

    cfg = config_mod.build(config_mod.JobConfig, config)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(cfg.train.seed)
        spec = build_model(cfg.model, cfg.train)
        steps = strategies.get("tensor").steps(spec, cfg, device, world)
        gen = torch.Generator().manual_seed(cfg.train.seed)  # the group reads the same rows
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1), generator=gen)
        tokens = tokens.to(device)

        def micro_batch() -> None:
            with steps.loss_context():
                spec.loss_fn(steps.model, tokens).backward()
            steps.model.zero_grad(set_to_none=True)

        micro_batch()  # warm-up: the first call builds the redistribution plans
        timed = _timed_mode_class()(device, "nccl" if cuda else "gloo")
        with timed:
            for _ in range(repeats):
                micro_batch()
        if rank == 0:
            with open(out, "w") as handle:
                json.dump(timed.records, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _timed_mode_class() -> type:
    """The dispatch mode (built on first use: torch's distributed modules load only here)."""
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    collectives = {*NATIVE_TO_PY_MAPPING, *NATIVE_TO_PY_MAPPING.values(), *c10d_collective_ops}

    class Timed(TorchDispatchMode):
        """Every collective under it waited for, timed and sized, filed under the modules running
        (torch's ModTracker: forward and backward, a module called twice counted where it runs)."""

        def __init__(self, device: torch.device, backend: str) -> None:
            super().__init__()
            self.device, self.backend = device, backend
            self.records: list[dict[str, Any]] = []
            self.tracker = ModTracker()

        def __enter__(self):
            self.tracker.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.tracker.__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(t == DTensor for t in types):
                return NotImplemented  # DTensor runs first and desugars into the collectives seen below
            packet = getattr(func, "_overloadpacket", None)
            if packet not in collectives:
                return func(*args, **kwargs)
            self._sync()
            started = time.perf_counter()
            out = func(*args, **kwargs)
            name = packet.__name__.rstrip("_")
            if isinstance(out, torch.Tensor) and name in _TIMED:  # a functional collective: wait for it
                out = torch.ops._c10d_functional.wait_tensor(out)
            self._sync()
            seconds = time.perf_counter() - started
            buffer = out if name == "all_gather_into_tensor" else args[0]
            if isinstance(buffer, (list, tuple)):  # c10d's in-place ops take lists of tensors
                buffer = buffer[0] if buffer else None
            size = buffer.numel() * buffer.element_size() if isinstance(buffer, torch.Tensor) else 0
            parents = sorted(self.tracker.parents - {"Global"}, key=len)  # ModTracker's root: no module
            self.records.append(
                {
                    "layer": layer_of(" ".join(parents)),
                    "module": parents[-1] if parents else "",
                    "phase": "backward" if self.tracker.is_bw else "forward",
                    "op": name,
                    "bytes": size,
                    "seconds": seconds,
                    "backend": self.backend,
                }
            )
            return out

        def _sync(self) -> None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    return Timed


def _TimedCollectives(device: torch.device, backend: str) -> Any:
    return _timed_mode_class()(device, backend)
