"""The accelerator catalog (`catalog.yaml`, shipped in the package) and price overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from importlib import resources

import yaml

from petatrain.config import PlanConfig
from petatrain.errors import ConfigError

GIB = 2**30


@dataclass(kw_only=True, slots=True, frozen=True)
class Accelerator:
    """One accelerator type; throughputs are dense, link bandwidths per direction."""

    name: str
    vendor: str
    memory_gib: float
    memory_bandwidth_gb_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    fp32_tflops: float
    intra_link: str
    intra_link_gb_s_per_direction: float
    pcie_gen: int
    pcie_gb_s_per_direction: float
    node_devices: int
    network_gbit_per_node: float
    power_w: float
    efficiency: float
    overhead_gib: float
    spec_source: str
    usd_per_hour: float
    usd_per_hour_spot: float
    price_source: str
    price_as_of: str
    price_checked: bool

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s for the training precision (bf16-mixed runs its matmuls in BF16)."""
        return 1e12 * (self.bf16_tflops if precision == "bf16-mixed" else self.fp32_tflops)

    def network_bytes_per_device(self) -> float:
        """Inter-node bandwidth per device, per direction, in bytes/s."""
        return self.network_gbit_per_node * 1e9 / 8 / self.node_devices


@cache
def _raw_catalog() -> dict[str, dict]:
    text = resources.files("petatrain.plan").joinpath("catalog.yaml").read_text()
    return yaml.safe_load(text)


def load_catalog(plan: PlanConfig | None = None) -> dict[str, Accelerator]:
    """All catalog entries by name, with the config's price overrides applied."""
    plan = plan or PlanConfig()
    raw = _raw_catalog()
    for key in ("prices", "spot_prices"):
        for name in getattr(plan, key):
            if name not in raw:
                raise ConfigError(f"plan.{key}.{name}: not in the accelerator catalog ({', '.join(raw)})")
    out = {}
    fields = {f.name for f in dataclasses.fields(Accelerator)}
    for name, entry in raw.items():
        price = entry["price"]
        on_demand = float(plan.prices.get(name, price["usd_per_hour"]))
        spot = float(plan.spot_prices.get(name, on_demand * plan.spot_fraction))
        values = {k: v for k, v in entry.items() if k in fields}
        out[name] = Accelerator(
            name=name,
            usd_per_hour=on_demand,
            usd_per_hour_spot=spot,
            price_source="job config (plan.prices)" if name in plan.prices else price["source"],
            price_as_of="" if name in plan.prices else str(price["as_of"]),
            price_checked=bool(price.get("checked", False)) and name not in plan.prices,
            **values,
        )
    return out


def find(name: str, catalog: dict[str, Accelerator]) -> Accelerator:
    """Case-insensitive lookup; the error lists the known names."""
    for key, acc in catalog.items():
        if key.lower() == name.strip().lower():
            return acc
    raise ConfigError(f"--accelerator {name!r} is not in the catalog; known: {', '.join(catalog)}")
