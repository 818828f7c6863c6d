"""What each unit of a model costs, measured (`petatrain profile --layers`): the per-unit forward +
backward time of one micro-batch, its output activation bytes, the bytes autograd saves for its
backward (memory.SavedActivations) and its parameter bytes, and the point-to-point time between two
ranks here. Saved beside the calibration (plan.calibration_dir,
`layers-<key>.json`, the key naming the model, micro-batch, precision and device), read by the
`profile` partitioner and by the stage table's predictions.

A unit is what a stage boundary may fall between: the embedding ("first"), each block, the final
norm and head ("last"); see layout.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from petatrain.config import JobConfig
from petatrain.cost.calibration import calibration_dir
from petatrain.errors import ConfigError, PetatrainError
from petatrain.models import ModelSpec, build_model
from petatrain.train import recipe
from petatrain.train.pipeline.layout import part_costs, units
from petatrain.train.pipeline.memory import SavedActivations, activation_peak

# Untimed runs of each unit first: the allocator's first large blocks, caches, lazy initialisation
WARM_UP = 3


@dataclass(kw_only=True, slots=True)
class LayerProfile:
    device: str
    micro_batch: int
    units: list[str]
    seconds: list[float]  # forward + backward of one micro-batch, per unit (median of the repetitions)
    activation_bytes: list[int]  # each unit's output, per micro-batch
    param_bytes: list[int]
    saved_bytes: list[int] = dataclasses.field(default_factory=list)  # held for backward, per micro-batch
    p2p_latency_s: float | None = None  # a one-element send/recv between two ranks here
    p2p_bytes_per_s: float | None = None  # for a micro-batch's activation
    repetitions: int = 0
    measured_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def scaled(self, micro_batch: int) -> list[float]:
        """Per-unit seconds at another micro-batch size (compute grows with the rows it processes)."""
        return [s * micro_batch / self.micro_batch for s in self.seconds]


def profile_key(cfg: JobConfig, device: str) -> str:
    """The model, arithmetic and device a layer profile holds for (not the batch: it scales)."""
    t = cfg.train
    what = {
        "model": dataclasses.asdict(cfg.model),
        "precision": t.precision,
        "attention": t.attention,
        "recompute": t.activation_checkpointing,
        "device": device,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def path_for(cfg: JobConfig, device: str) -> Path:
    return calibration_dir(cfg.plan.calibration_dir) / f"layers-{profile_key(cfg, device)}.json"


def load(cfg: JobConfig, device: str) -> LayerProfile | None:
    """The saved layer profile of this model on `device`, or None; an unreadable file is an error naming it."""
    path = path_for(cfg, device)
    if not path.is_file():
        return None
    try:
        profile = LayerProfile(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise PetatrainError(f"layer profile {path} is unreadable ({exc}); run profile --layers again") from None
    if len(profile.seconds) != len(profile.units) or min(profile.seconds, default=0) < 0:
        raise PetatrainError(f"layer profile {path} is inconsistent; run profile --layers again")
    return profile


def save(profile: LayerProfile, cfg: JobConfig) -> Path:
    path = path_for(cfg, profile.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2))
    tmp.replace(path)
    return path


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def measure(cfg: JobConfig, micro_batch: int, device: torch.device, *, repetitions: int = 5) -> LayerProfile:
    """Time each unit's forward and backward on one micro-batch of random tokens, inside whole passes
    through the model (`_pass_seconds`: a unit timed alone, over and over, runs from caches no
    training step leaves it); count what each unit saves for its backward, alone.

    On the CPU a stage that waits for its neighbours computes slower than any profile shows: a pass
    after a 20 ms sleep took 8-15% longer here, after another process thrashed the cache 20%; a
    2-stage pipeline's cheap stage (busy 21% of the step) computed 40% slower than its units' sum,
    its busy bottleneck within 5% (benchmarks/pipeline.py, README). Not so on an accelerator."""
    torch.manual_seed(cfg.train.seed)
    spec = build_model(cfg.model, cfg.train)
    if spec.pipeline is None:
        raise ConfigError(f"model.kind {cfg.model.kind}: profile --layers needs a model that names its pipeline parts")
    torch.set_flush_denormal(cfg.train.flush_denormal)
    if device.type == "cpu":  # a training rank computes on the cores Ray gives it (OMP_NUM_THREADS)
        torch.set_num_threads(max(1, int(cfg.resources.cpus_per_worker)))
    module: Any = spec.module.to(device).train()
    blocks = list(getattr(module, spec.pipeline.blocks))
    names = units(len(blocks))
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1), device=device)
    amp = recipe.autocast(cfg.train, device)
    with torch.no_grad(), amp:
        hidden = module.embed(tokens[:, :-1])
    activations, params, saved = [], [], []
    for i in range(len(names)):
        with SavedActivations(list(module.parameters())) as held, amp:
            out = _unit_forward(spec, module, blocks, i, tokens, hidden)
        saved.append(held.peak)
        activations.append(int(out.numel() * out.element_size()))
        params.append(_param_bytes(spec, module, blocks, i))
    passes = [_pass_seconds(spec, module, blocks, tokens, amp, device) for _ in range(WARM_UP + repetitions)]
    seconds = [statistics.median(column) for column in zip(*passes[WARM_UP:], strict=True)]
    return LayerProfile(
        device=device_name(device), micro_batch=micro_batch, units=names, seconds=seconds,
        activation_bytes=activations, param_bytes=params, saved_bytes=saved, repetitions=repetitions,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )  # fmt: skip


def _pass_seconds(
    spec: ModelSpec, module: Any, blocks: list[torch.nn.Module], tokens: torch.Tensor, amp: Any, device: torch.device
) -> list[float]:
    """One forward and backward through every unit, as a step runs them: each unit's seconds, its
    forward between the clock readings at its ends, its backward between the gradients reaching its
    output and its input (a hook on the tensor between two units)."""
    parts = spec.pipeline
    assert parts is not None
    n = len(blocks)

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    forward, reached = [0.0] * (n + 2), [0.0] * (n + 2)  # reached[i]: the gradient of unit i's input is in
    run_block = getattr(module, "run_block", None)
    t = now()
    with amp:
        x = module.embed(tokens[:, :-1])
        for i in range(1, n + 2):
            forward[i - 1], t = now() - t, now()
            x.register_hook(lambda _, i=i: reached.__setitem__(i, now()))
            if i <= n:
                x = run_block(blocks[i - 1], x) if run_block else blocks[i - 1](x)
            else:
                x = parts.output_loss(module.finish(x), tokens[:, 1:])
        forward[n + 1] = now() - t
    start = now()
    x.backward()
    end = now()
    module.zero_grad(set_to_none=True)
    backward = [end - reached[1], *(reached[i] - reached[i + 1] for i in range(1, n + 1)), reached[n + 1] - start]
    return [f + b for f, b in zip(forward, backward, strict=True)]


def _unit_forward(
    spec: ModelSpec, module: Any, blocks: list[torch.nn.Module], i: int, tokens: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """Unit `i`'s forward alone, on `hidden` (what the embedding gives) as its input; the last unit's
    includes the loss, which the last stage computes too. Its output."""
    n = len(blocks)
    parts = spec.pipeline
    assert parts is not None
    x = hidden.detach().requires_grad_(True)
    if i == 0:
        return module.embed(tokens[:, :-1])
    if i == n + 1:
        out = module.finish(x)
        parts.output_loss(out, tokens[:, 1:])
        return out
    run_block = getattr(module, "run_block", None)
    return run_block(blocks[i - 1], x) if run_block else blocks[i - 1](x)


def _param_bytes(spec: ModelSpec, module: Any, blocks: list[torch.nn.Module], i: int) -> int:
    parts = spec.pipeline
    assert parts is not None
    if i == 0:
        mods = [getattr(module, n) for n in parts.first]
    elif i == len(blocks) + 1:
        mods = [getattr(module, n) for n in parts.last]
    else:
        mods = [blocks[i - 1]]
    return sum(p.numel() * p.element_size() for m in mods for p in m.parameters())


def predict_rank(
    profile: LayerProfile, piped: Any, micro_batch: int, *, sharded: bool, copies: float = 4.0
) -> tuple[float, int, int | None]:
    """What the profile predicts for a rank (`stages.PipelineRank`) of a step: (its compute seconds:
    its parts' per-micro-batch costs, M times; its state bytes: `copies` (memory.state_copies) of its
    parts' parameter bytes, split over the replicas under FSDP; the most activation bytes its
    schedule's actions hold at once, or None for a profile without saved bytes). A stage split by
    `layout.tensor` ranks is predicted as its share of each, as plan models tensor parallelism (its
    collectives are not in the profile of the whole model)."""
    plan, layout = piped.plan, piped.layout
    tensor = layout.tensor
    starts = list(plan.starts)
    per_part = stage_seconds(profile, starts, micro_batch)
    busy = piped.microbatches * sum(per_part[k] for k in piped.parts) / tensor
    mine = [u for k in piped.parts for u in plan.units(k)]
    state = int(copies * sum(profile.param_bytes[u] for u in mine)) // (layout.replicas if sharded else 1) // tensor
    activations = None
    order = getattr(piped.schedule, "pipeline_order", None)
    if profile.saved_bytes and order is not None:
        scale = micro_batch / profile.micro_batch
        saved = {k: scale * sum(profile.saved_bytes[u] for u in plan.units(k)) for k in range(layout.parts)}
        activations = int(activation_peak(order[layout.pp_rank(piped.rank)], saved)) // tensor
    return busy, state, activations


def device_memory(device: torch.device) -> float:
    """What a part may hold on `device`: 90% of an accelerator's memory (the rest for the allocator's
    slack and the communication buffers); 0 (no limit) on the CPU."""
    if device.type != "cuda":
        return 0.0
    return 0.9 * torch.cuda.get_device_properties(device).total_memory


def unit_memory(
    profile: LayerProfile, micro_batch: int, pc: Any, *, replicas: int = 1, copies: float = 4.0, tensor: int = 1
) -> list[float]:
    """Each unit's predicted bytes on the rank that runs it: its state (`copies` of its parameter
    bytes, memory.state_copies; split over the replicas under data fsdp) and its saved activations for as many
    micro-batches as the schedule can hold at once (GPipe: all; the others: the first stage's
    stages x chunks, the most); a `tensor`-way split stage holds its share of both."""
    m = pc.microbatch_count()
    in_flight = m if pc.schedule == "gpipe" else min(m, pc.stages * pc.chunks_per_rank())
    share = replicas if pc.data == "fsdp" else 1
    saved = profile.saved_bytes or profile.activation_bytes
    scale = micro_batch / profile.micro_batch
    return [
        (copies * p / share + in_flight * a * scale) / tensor for p, a in zip(profile.param_bytes, saved, strict=True)
    ]


def stage_seconds(profile: LayerProfile, plan_starts: list[int], micro_batch: int) -> list[float]:
    """Predicted forward + backward seconds of one micro-batch per part."""
    return part_costs(profile.scaled(micro_batch), plan_starts)


def measure_together(cfg: JobConfig, micro_batch: int, ranks: int, *, repetitions: int = 5) -> LayerProfile:
    """`measure` on the CPU in `ranks` processes at once, as a pipeline's ranks share this host's cores
    and memory bandwidth while they train (the per-unit median over the processes), then the
    point-to-point time between two of them: a one-element ping-pong (latency) and one of an
    activation's size or 8 MiB, whichever is larger (bandwidth)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/layers.json"
        args = (ranks, f"file://{folder}/store", cfg, micro_batch, repetitions, out)
        mp.start_processes(_profile_rank, args=args, nprocs=ranks, start_method="spawn")
        return LayerProfile(**json.loads(Path(out).read_text()))


def _profile_rank(rank: int, ranks: int, init: str, cfg: JobConfig, micro: int, repetitions: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        dist.barrier()
        mine = measure(cfg, micro, torch.device("cpu"), repetitions=repetitions)
        everyone: list[Any] = [None] * ranks
        dist.all_gather_object(everyone, mine.seconds)
        mine.seconds = [statistics.median(column) for column in zip(*everyone, strict=True)]
        if ranks > 1:
            size = max(8 << 20, max(mine.activation_bytes[1:-1] or [4]))
            mine.p2p_latency_s, mine.p2p_bytes_per_s = _ping_pong(rank, size, repetitions=20)
        if rank == 0:
            Path(out).write_text(json.dumps(mine.to_dict()))
    finally:
        dist.destroy_process_group()


def _ping_pong(rank: int, size: int, *, repetitions: int) -> tuple[float, float]:
    """(latency, bytes per second) one way between ranks 0 and 1 (the others wait at the barrier)."""
    import torch.distributed as dist

    timings = {}
    for name, numel in (("small", 1), ("large", size // 4)):
        buffer = torch.zeros(numel, dtype=torch.float32)
        samples = []
        for _ in range(repetitions + 1):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            samples.append((time.perf_counter() - t0) / 2)
        timings[name] = statistics.median(samples[1:])
    dist.barrier()
    latency = timings["small"]
    return latency, size / max(timings["large"] - latency, timings["large"] / 2)
