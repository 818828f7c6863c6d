"""Pipeline parallelism, 1F1B (Narayanan et al. 2021): the layers split into `count` stages, the
global batch's micro-batches flow through them. Modelled by `plan`; `train` does not run it yet."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from petatrain.cost import formulas
from petatrain.train.strategies.base import StateLayout, Strategy, autocast_copies

if TYPE_CHECKING:
    from petatrain.cost.workload import Workload


class Pipeline(Strategy):
    name = "pipeline"

    def data_parallel(self, count: int) -> int:
        return 1  # every stage sees the whole global batch

    def infeasible(self, w: Workload, count: int) -> str:
        if count < 2 or count > w.n_layer:
            return f"pipeline needs 2..{w.n_layer} stages (model.n_layer), not {count}"
        return ""

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        P, n = w.params, count
        stage_layers = math.ceil(w.n_layer / n)
        return StateLayout(
            weights=w.weight_width * P / n,
            gradients=w.grad_width * P / n,
            optimizer=w.optimizer_width * P / n,
            buffers=autocast_copies(w, stage_layers),
            stage_layers=stage_layers,
            in_flight=min(n, accumulation),  # 1F1B: the first stage holds p micro-batches
            optimizer_shards=n,
        )

    def communication_s(
        self, w: Workload, count: int, *, compute_s: float, accumulation: int, bandwidth: float
    ) -> tuple[float, float]:
        if count <= 1:
            return 0.0, 0.0
        # Activations forward and their gradients back across each stage boundary, per micro-batch.
        act_bytes = w.micro_batch * w.seq_len * w.d_model * w.activation_bytes_per_element
        return accumulation * 2 * act_bytes / bandwidth, compute_s * formulas.bubble_overhead(count, accumulation)
