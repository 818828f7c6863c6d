"""ZeRO-1 and ZeRO-2 (Rajbhandari et al. 2020): DDP with the optimizer states (1), and the
gradients too (2), partitioned over the ranks. Modelled by `plan`; `train` does not run them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from petatrain.train.strategies.base import StateLayout, Strategy, autocast_copies
from petatrain.train.strategies.ddp import allreduce_exposed_s, bucket_bytes

if TYPE_CHECKING:
    from petatrain.cost.workload import Workload


class ZeRO(Strategy):
    stage: int

    def state_layout(self, w: Workload, count: int, accumulation: int) -> StateLayout:
        P, n = w.params, count
        return StateLayout(
            weights=w.weight_width * P,
            gradients=w.grad_width * P / (n if self.stage >= 2 else 1),
            optimizer=w.optimizer_width * P / n,
            buffers=autocast_copies(w, w.n_layer) + bucket_bytes(w, count),
            stage_layers=w.n_layer,
            grad_shards=n,
            optimizer_shards=n,
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
        return allreduce_exposed_s(w, count, compute_s=compute_s, bandwidth=bandwidth), 0.0


class ZeRO1(ZeRO):
    name = "zero1"
    stage = 1


class ZeRO2(ZeRO):
    name = "zero2"
    stage = 2
