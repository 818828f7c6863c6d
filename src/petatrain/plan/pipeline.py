"""`petatrain profile --layers`: measure each unit of the model, then predict each pipeline stage's
time and memory under the three partitions (`uniform`, `parameters`, `profile`) for the config's
stages, schedule and micro-batches."""

from __future__ import annotations

import os
from typing import Any

import torch

from petatrain.config import JobConfig
from petatrain.cost import formulas
from petatrain.models import build_model
from petatrain.train.pipeline import costs
from petatrain.train.pipeline.layout import partition, uniform
from petatrain.train.pipeline.memory import state_copies
from petatrain.train.strategies.pipeline import parameter_costs


def micro_batch(cfg: JobConfig) -> int:
    """The rows of one pipeline micro-batch at the most workers (the config's own micro-batch otherwise)."""
    if cfg.parallel.strategy != "pipeline":
        return cfg.train.micro_batch
    pc = cfg.parallel.pipeline
    replicas = cfg.parallel.data_parallel(cfg.parallel.worker_range()[1])
    return max(1, cfg.train.global_batch // replicas // pc.microbatch_count())


def profile_layers(cfg: JobConfig, *, repetitions: int = 5, p2p: bool = True, save: bool = True) -> dict[str, Any]:
    """Measure the units here (and the point-to-point link between two ranks), save the profile, and
    compare the partitions' predicted stages."""
    micro = micro_batch(cfg)
    if torch.cuda.is_available():  # a stage per accelerator: measured alone
        profile = costs.measure(cfg, micro, torch.device("cuda"), repetitions=repetitions)
    else:  # the stages' ranks share this host: measured side by side, as they will train
        ranks = max(1, min(cfg.parallel.pipeline.stages, os.cpu_count() or 1)) if p2p else 1
        profile = costs.measure_together(cfg, micro, max(ranks, 2) if p2p else 1, repetitions=repetitions)
    path = str(costs.save(profile, cfg)) if save else None
    return {"profile": profile.to_dict(), "path": path, "partitions": compare(cfg, profile, micro)}


def compare(cfg: JobConfig, profile: costs.LayerProfile, micro: int) -> list[dict[str, Any]]:
    """Each partition's stages: units, predicted forward + backward per micro-batch, memory, and the
    step time the schedule implies ((M + P - 1) x the slowest stage's micro-batch, plus the transfers)."""
    pc = cfg.parallel.pipeline
    parts = pc.stages * pc.chunks_per_rank()
    m = pc.microbatch_count()
    n_blocks = len(profile.units) - 2
    torch.manual_seed(cfg.train.seed)
    spec = build_model(cfg.model, cfg.train)
    seconds = profile.scaled(micro)
    choices = {
        "uniform": uniform(n_blocks, parts),
        "parameters": partition(parameter_costs(spec), parts),
        "profile": partition(seconds, parts),
    }
    state = state_copies(cfg.train.optimizer, cfg.train.precision)
    # what a micro-batch keeps for its backward, per unit (older profiles: the unit's output only)
    held = [b * micro / profile.micro_batch for b in profile.saved_bytes] or profile.activation_bytes
    out = []
    for name, starts in choices.items():
        per_part = costs.stage_seconds(profile, starts, micro)
        ends = [*starts[1:], len(seconds)]
        stages = []
        for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
            in_flight = m if pc.schedule == "gpipe" else min(m, parts - k)  # 1F1B: stage k holds P - k micro-batches
            stages.append(
                {
                    "units": f"{profile.units[a]}..{profile.units[b - 1]}",
                    "seconds_per_micro": per_part[k],
                    "state_bytes": state * sum(profile.param_bytes[a:b]),
                    "activation_bytes": in_flight * sum(held[a:b]),
                }
            )
        transfer = 0.0
        if profile.p2p_bytes_per_s and parts > 1:  # an activation forward and its gradient back per boundary
            act = max(profile.activation_bytes[1:-1] or [0])
            transfer = 2 * (profile.p2p_latency_s or 0.0) + 2 * act / profile.p2p_bytes_per_s
        slowest = max(per_part)
        step = (m + parts - 1) * (slowest + transfer) if parts > 1 else m * slowest
        out.append(
            {
                "partition": name,
                "starts": starts,
                "stages": stages,
                "step_s": step,
                "imbalance": slowest / (sum(per_part) / len(per_part)),
                "bubble_theory": formulas.bubble_fraction(pc.stages, m, pc.chunks_per_rank()),
            }
        )
    return out
