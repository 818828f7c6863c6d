"""`petatrain plan`: the published formulas against the papers' own numbers, the FLOP counter
against the analytic count, the memory estimate against torch's MemTracker, and the recommender."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import ROOT, run_cli
from petatrain import config as config_mod
from petatrain.config import JobConfig, ModelConfig, TrainConfig
from petatrain.cost.calibration import Calibration, load_calibrations, save_calibration
from petatrain.errors import ConfigError, PetatrainError
from petatrain.models import build_model, count_params
from petatrain.plan import estimate as est
from petatrain.plan.catalog import load_catalog
from petatrain.plan.flops import FlopCounter, count_training_step
from petatrain.plan.recommend import PlanRequest, plan


def matches_printed(value: float, printed: str) -> bool:
    """The paper prints `printed`; our value rounds to it at the paper's precision."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10**-decimals * (1 + 1e-9)  # half a unit of the last digit


# --- ZeRO (Rajbhandari et al. 2020) ---------------------------------------------------


# Figure 1: Ψ = 7.5B, Nd = 64, K = 12 (GB = 1e9 bytes).
def test_zero_figure1_model_states():
    psi = 7.5e9
    got = [est.zero_model_state_bytes(psi, stage, 64) / 1e9 for stage in (0, 1, 2, 3)]
    for value, printed in zip(got, ("120", "31.4", "16.6", "1.88"), strict=True):
        assert matches_printed(value, printed), (value, printed)
    assert got[0] == pytest.approx(120, rel=1e-3) and got[1] == pytest.approx(31.4, rel=1e-3)


# Table 1: per-device model-state memory (GB) for P_os, P_os+g, P_os+g+p by DP degree.
ZERO_TABLE1 = {
    # DP: (7.5B: os, os+g, os+g+p), (128B: ...), (1T: ...)
    1: (("120", "120", "120"), ("2048", "2048", "2048"), ("16000", "16000", "16000")),
    4: (("52.5", "41.3", "30"), ("896", "704", "512"), ("7000", "5500", "4000")),
    16: (("35.6", "21.6", "7.5"), ("608", "368", "128"), ("4750", "2875", "1000")),
    64: (("31.4", "16.6", "1.88"), ("536", "284", "32"), ("4187.5", "2218.75", "250")),
    256: (("30.4", "15.4", "0.47"), ("518", "263", "8"), ("4046.9", "2054.7", "62.5")),
}


@pytest.mark.parametrize("dp", sorted(ZERO_TABLE1))
def test_zero_table1(dp):
    for psi, row in zip((7.5e9, 128e9, 1e12), ZERO_TABLE1[dp], strict=True):
        for stage, printed in zip((1, 2, 3), row, strict=True):
            value = est.zero_model_state_bytes(psi, stage, dp) / 1e9
            assert matches_printed(value, printed), (psi, dp, stage, value, printed)
            if len(printed.replace(".", "").lstrip("0")) >= 4:  # printed to 4+ significant digits
                assert value == pytest.approx(float(printed), rel=1e-3)


# --- Narayanan et al. 2021 (Megatron-LM at scale), Table 1 ---------------------------

# (printed parameters in billions, attention heads, hidden size, layers); V = 51,200, s = 2048.
MEGATRON_TABLE1 = [
    ("1.7", 24, 2304, 24),
    ("3.6", 32, 3072, 30),
    ("7.5", 32, 4096, 36),
    ("18.4", 48, 6144, 40),
    ("39.1", 64, 8192, 48),
    ("76.1", 80, 10240, 60),
    ("145.6", 96, 12288, 80),
    ("310.1", 128, 16384, 96),
    ("529.6", 128, 20480, 105),
    ("1008.0", 160, 25600, 128),
]


@pytest.mark.parametrize(("printed", "heads", "h", "layers"), MEGATRON_TABLE1)
def test_megatron_parameter_count(printed, heads, h, layers):
    value = est.megatron_params(layers, h, 51200, 2048) / 1e9
    assert matches_printed(value, printed)
    if len(printed.replace(".", "")) >= 4:
        assert value == pytest.approx(float(printed), rel=1e-3)


def test_megatron_training_time_examples():
    """§5.1: GPT-3 (175B, 300B tokens) on 1024 A100s at 140 TFLOP/s takes 34 days; the 1T model
    (450B tokens, 3072 GPUs, 163 TFLOP/s) 84 days."""
    assert round(est.megatron_training_seconds(300e9, 175e9, 1024, 140e12) / 86400) == 34
    one_t = est.megatron_params(128, 25600, 51200, 2048)
    assert round(est.megatron_training_seconds(450e9, one_t, 3072, 163e12) / 86400) == 84


@pytest.mark.parametrize(("printed", "heads", "h", "layers"), MEGATRON_TABLE1[::3])
def test_flops_per_iteration_is_our_component_count_with_full_recompute(printed, heads, h, layers):
    """96·B·s·l·h²(1 + s/6h + V/16lh) = 3 × forward + one more forward of every layer, with the
    forward counted matmul by matmul (unmasked attention) exactly as Workload does."""
    B, s, V = 8, 2048, 51200
    cfg = JobConfig(
        model=ModelConfig(n_layer=layers, n_head=heads, d_model=h, vocab_size=V, seq_len=s),
        train=TrainConfig(global_batch=B, micro_batch=B, attention="math"),
    )
    w = est.Workload.from_config(cfg)
    layer_forward = 2 * B * s * 12 * h * h + 4 * B * s * s * h
    ours = w.executed_flops(B) + layers * layer_forward
    assert ours == pytest.approx(est.megatron_flops_per_iteration(B, s, layers, h, V), rel=1e-12)
    # Korthikanti et al. §6's model FLOPs 72·B·s·l·h²(1 + s/6h + V/12lh) is our PaLM accounting.
    assert w.model_flops(B) == pytest.approx(est.megatron_model_flops_per_iteration(B, s, layers, h, V), rel=1e-12)


# --- PaLM (Chowdhery et al. 2022), Appendix B ----------------------------------------


def test_palm_540b_mfu():
    """540B (L=118, H=48, Q=256, T=2048) at 238.3K tokens/s on 6144 TPU v4 (275 TFLOP/s): 46.2% MFU."""
    per_token = est.palm_flops_per_token(540.35e9, 118, 48, 256, 2048)
    assert matches_printed(100 * est.mfu(238.3e3, per_token, 6144 * 275e12), "46.2")


# --- Korthikanti et al. 2022, Table 2 -------------------------------------------------


@pytest.mark.parametrize(
    ("s", "b", "h", "a", "t"), [(2048, 1, 6144, 64, 8), (2048, 1, 12288, 96, 8), (4096, 4, 1024, 16, 2)]
)
def test_korthikanti_table2(s, b, h, a, t):
    sbh = s * b * h
    f = est.korthikanti_activation_bytes_per_layer
    assert f(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert f(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert f(s, b, h, a, t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
    assert f(s, b, h, a, t, sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t, rel=1e-12)
    assert f(s, b, h, a, recompute="selective") == pytest.approx(34 * sbh, rel=1e-12)
    assert f(s, b, h, a, recompute="full") == pytest.approx(2 * sbh, rel=1e-12)


# --- pipeline bubble: the formula against a simulated schedule ------------------------


def simulate_pipeline(p: int, m: int, schedule: str, tf: float = 1.0, tb: float = 2.0) -> float:
    """Idle share of a GPipe or 1F1B schedule, by list-scheduling every op with its dependencies."""
    orders = []
    for i in range(p):
        if schedule == "gpipe":
            order = [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        else:
            warm = min(p - i - 1, m)
            order = [("F", j) for j in range(warm)]
            f, b = warm, 0
            while b < m:
                if f < m:
                    order.append(("F", f))
                    f += 1
                order.append(("B", b))
                b += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    while any(pos[i] < len(orders[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            if pos[i] == len(orders[i]):
                continue
            kind, j = orders[i][pos[i]]
            deps = [("F", i - 1, j)] if kind == "F" and i else []
            if kind == "B":
                deps = [("F", i, j)] + ([("B", i + 1, j)] if i < p - 1 else [])
            if all(d in done for d in deps):
                start = max([free[i], *(done[d] for d in deps)])
                free[i] = done[(kind, i, j)] = start + (tf if kind == "F" else tb)
                pos[i] += 1
                progressed = True
        assert progressed
    total = max(free)
    return 1 - m * (tf + tb) / total


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_fraction_matches_simulated_schedules(p, m, schedule):
    assert simulate_pipeline(p, m, schedule) == pytest.approx(est.bubble_fraction(p, m), rel=1e-9)
    # Narayanan's overhead (bubble over ideal time) is the same bubble, measured against m·(tf+tb).
    f = est.bubble_fraction(p, m)
    assert est.bubble_overhead(p, m) == pytest.approx(f / (1 - f), rel=1e-12)


def test_interleaved_bubble():
    assert est.bubble_overhead(8, 16, v=4) == pytest.approx(7 / 64)
    assert est.bubble_fraction(8, 16, v=4) == pytest.approx(7 / (64 + 7))


# --- checkpoint interval and goodput --------------------------------------------------


def test_young_daly_interval():
    d, m = 60.0, 86400.0
    young = math.sqrt(2 * d * m)
    tau = est.young_daly_interval(d, m)
    assert young * 0.97 < tau < young  # Daly subtracts δ and adds small higher-order terms
    assert est.young_daly_interval(3 * m, m) == m  # δ ≥ 2M: checkpoint once per MTBF
    # The optimum beats its neighbours in the goodput model it comes from.
    g = [est.expected_goodput(x * tau, d, 0.0, m) for x in (0.5, 1.0, 2.0)]
    assert g[1] > g[0] and g[1] > g[2]


# --- parameter count and FLOP counter against the real model ---------------------------

SMALL = [
    {},
    {"n_layer": 3, "n_head": 4, "d_model": 128, "vocab_size": 1000, "seq_len": 48},
    {"n_layer": 2, "d_model": 96, "n_head": 3, "d_ff": 200, "seq_len": 32},
    {"kind": "mlp", "n_layer": 2, "d_model": 64},
]


@pytest.mark.parametrize("model", SMALL)
def test_param_count_matches_the_model(model):
    cfg = JobConfig(model=ModelConfig(**model))
    w = est.Workload.from_config(cfg)
    assert w.params == count_params(build_model(cfg.model, cfg.train).module)


@pytest.mark.parametrize(
    "train",
    [{}, {"attention": "math"}, {"activation_checkpointing": "full"}, {"activation_checkpointing": "selective"}],
)
@pytest.mark.parametrize("model", SMALL[:3])
def test_flop_counter_agrees_with_analytic_count(model, train):
    cfg = JobConfig(model=ModelConfig(**model), train=TrainConfig(global_batch=4, micro_batch=4, **train))
    torch.manual_seed(0)
    spec = build_model(cfg.model, cfg.train)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1))
    counted = count_training_step(spec.module.train(), spec.loss_fn, tokens).total
    analytic = est.Workload.from_config(cfg).executed_flops(4)
    assert counted == pytest.approx(analytic, rel=0.01)


def test_flop_counter_counts_cpu_sdpa_and_causal_masks():
    from torch.utils.flop_counter import FlopCounterMode

    B, H, T, D = 2, 4, 64, 16
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as theirs:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert theirs.get_total_flops() == 0  # the gap this counter closes
    with FlopCounter() as full:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with FlopCounter() as causal:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert full.total == 4 * B * H * T * T * D
    forward_causal = 4 * B * H * D * T * (T + 1) // 2
    assert causal.total == 3 * forward_causal  # backward = 2 × forward, both over the lower triangle


# --- memory estimate against torch's own tracker (real CPU runs) ------------------------

MEMORY_CONFIGS = [
    ({}, {"micro_batch": 8}),
    ({}, {"micro_batch": 32, "attention": "math"}),
    ({}, {"micro_batch": 32, "activation_checkpointing": "full"}),
    ({}, {"micro_batch": 32, "activation_checkpointing": "selective"}),
    ({"n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 1024, "seq_len": 128}, {"micro_batch": 4}),
    ({"n_layer": 2, "d_model": 512, "n_head": 8, "vocab_size": 512, "seq_len": 32}, {"micro_batch": 2}),
    ({"n_layer": 3, "d_model": 128, "n_head": 4, "vocab_size": 4096}, {"micro_batch": 8}),
    ({"dropout": 0.1}, {"micro_batch": 16}),
    ({}, {"micro_batch": 16, "optimizer": "sgd"}),
    (
        {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 256},
        {"micro_batch": 4, "activation_checkpointing": "full"},
    ),
    ({}, {"micro_batch": 16, "precision": "bf16-mixed"}),
    ({"kind": "mlp"}, {"micro_batch": 16}),
    ({}, {"micro_batch": 8, "global_batch": 16}),  # gradient accumulation: gradients live through backward
]


def measure_peak(cfg: JobConfig) -> int:
    """MemTracker's peak over one real training step (after a warm-up step)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from petatrain.train.recipe import build_optimizer

    torch.manual_seed(0)
    spec = build_model(cfg.model, cfg.train)
    model = spec.module.train()
    opt = build_optimizer(model, cfg.train)
    accumulation = cfg.train.global_batch // cfg.train.micro_batch
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len + 1))

    def step(before=None):
        for _ in range(accumulation):
            if before:
                before()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16-mixed"):
                loss = spec.loss_fn(model, tokens)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt, tokens)
    with tracker:
        step(tracker.reset_mod_stats)
    return max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.slow
def test_memory_estimate_within_10_percent_of_memtracker():
    rows = []
    for model, train in MEMORY_CONFIGS:
        train = {"global_batch": train.get("micro_batch", 8), **train}
        cfg = JobConfig(model=ModelConfig(**model), train=TrainConfig(**train))
        measured = measure_peak(cfg)
        w = est.Workload.from_config(cfg)
        estimate = est.memory_per_device(w, strategy="ddp", count=1, cpu=True).total
        rows.append((model, train, measured, estimate, (estimate - measured) / measured))
    bad = [r for r in rows if abs(r[4]) > 0.10]
    assert len(rows) >= 8 and not bad, bad


# --- catalog ------------------------------------------------------------------------------


def test_catalog_has_the_required_accelerators_with_units_and_prices():
    catalog = load_catalog()
    for name in ("H100-SXM", "H100-PCIe", "H200", "B200", "A100-40GB", "A100-80GB", "L40S", "L4", "A10G", "MI300X"):
        acc = catalog[name]
        assert acc.memory_gib > 0 and acc.memory_bandwidth_gb_s > 0 and acc.bf16_tflops > 0
        assert acc.intra_link_gb_s_per_direction > 0 and acc.pcie_gen in (4, 5, 6) and acc.power_w > 0
        assert acc.usd_per_hour > 0 and acc.price_source and acc.price_as_of
    # Per direction: NVLink 4's "900 GB/s" is both directions.
    assert catalog["H100-SXM"].intra_link_gb_s_per_direction == 450
    assert catalog["A100-40GB"].fp8_tflops is None


def test_config_price_overrides(tmp_path):
    cfg = config_mod.load(None, ["plan.prices.H100-SXM=2.0", "plan.spot_prices.H100-SXM=0.5"])
    acc = load_catalog(cfg.plan)["H100-SXM"]
    assert (acc.usd_per_hour, acc.usd_per_hour_spot, acc.price_checked) == (2.0, 0.5, False)
    with pytest.raises(ConfigError, match=r"plan\.prices\.H999"):
        load_catalog(config_mod.load(None, ["plan.prices.H999=1"]).plan)
    with pytest.raises(ConfigError, match=r"plan\.prices\.L4"):
        config_mod.load(None, ["plan.prices.L4=cheap"])


# --- recommender ---------------------------------------------------------------------------


def tiny_job(*overrides: str) -> JobConfig:
    return config_mod.load(
        None,
        [
            "model.n_layer=8",
            "model.n_head=16",
            "model.d_model=1024",
            "model.vocab_size=32000",
            "model.seq_len=1024",
            "train.global_batch=256",
            "train.micro_batch=8",
            "train.precision=bf16-mixed",
            "train.tokens=20000000000",
            *overrides,
        ],
    )


def test_plan_json_schema_and_70b_example():
    result = plan(config_mod.load(ROOT / "examples" / "plan-70b.yaml")).to_dict()
    assert set(result["model"]) >= {"params", "params_non_embedding"}
    assert 69e9 < result["model"]["params"] < 72e9
    keys = {
        "accelerator", "count", "strategy", "fits", "memory_bytes", "model_flops_per_step",
        "executed_flops_per_step", "step_time_s", "mfu", "tokens_per_s", "run_time_s", "cost_usd",
        "cost_usd_spot", "reason",
    }  # fmt: skip
    assert len(result["candidates"]) == 10 * 11 * 6  # accelerators x counts 1..1024 x strategies
    for c in result["candidates"]:
        assert keys <= set(c)
        assert set(c["memory_bytes"]) == {"weights", "gradients", "optimizer", "activations", "other", "total"}
        assert sum(v for k, v in c["memory_bytes"].items() if k != "total") == pytest.approx(
            c["memory_bytes"]["total"], abs=8
        )
        if not c["fits"]:
            assert c["reason"], c
    # A 70B model cannot train on one device of any kind: 16 bytes per parameter of model state alone.
    assert all(not c["fits"] for c in result["candidates"] if c["count"] == 1)
    rec = result["recommended"]
    assert rec["fits"] and not rec["reason"]
    assert rec["cost_usd"] == min(c["cost_usd"] for c in result["candidates"] if not c["reason"])


def test_deadline_picks_cheapest_in_time_and_rejects_the_slow():
    loose = plan(tiny_job()).recommended
    deadline_h = loose.run_time_s / 3600 * 0.99  # the cheapest overall is too slow now
    result = plan(tiny_job(), PlanRequest(deadline_hours=deadline_h))
    rec = result.recommended
    assert rec is not None and rec.run_time_s <= deadline_h * 3600 and rec.cost_usd > loose.cost_usd
    ok = [c for c in result.candidates if not c.reason]
    assert rec.cost_usd == min(c.cost_usd for c in ok)
    slow = [c for c in result.candidates if c.reason.startswith("too slow")]
    assert slow and all(c.run_time_s > deadline_h * 3600 for c in slow)


def test_budget_picks_fastest_within_budget():
    cheapest = plan(tiny_job()).recommended
    budget = cheapest.cost_usd * 5
    result = plan(tiny_job(), PlanRequest(budget_usd=budget))
    rec = result.recommended
    assert rec.cost_usd <= budget and rec.run_time_s < cheapest.run_time_s
    assert rec.run_time_s == min(c.run_time_s for c in result.candidates if not c.reason)
    assert any(c.reason.startswith("over budget") for c in result.candidates)


def test_out_of_memory_and_data_bound_reasons():
    result = plan(
        tiny_job("model.d_model=4096", "model.n_head=32", "model.n_layer=16"), PlanRequest(accelerator="L4", count=1)
    )
    assert all(
        c.reason.startswith("out of memory") for c in result.candidates if c.strategy not in ("pipeline", "tensor")
    )
    tensor = next(c for c in result.candidates if c.strategy == "tensor")
    assert tensor.reason.startswith("infeasible: no tensor-parallel degree"), tensor.reason  # one device: no group
    assert result.recommended is None
    starved = plan(tiny_job("plan.storage_bandwidth=1KB/s"), PlanRequest(accelerator="H100-SXM", count=8))
    assert any(c.reason.startswith("data-bound") for c in starved.candidates)


def test_recompute_trades_memory_for_flops():
    base = plan(tiny_job(), PlanRequest(accelerator="H100-SXM", count=1, strategies=("ddp",))).candidates[0]
    full = plan(
        tiny_job("train.activation_checkpointing=full"),
        PlanRequest(accelerator="H100-SXM", count=1, strategies=("ddp",)),
    ).candidates[0]
    assert full.memory.activations < base.memory.activations / 4
    assert full.executed_flops_per_step > base.executed_flops_per_step
    assert full.model_flops_per_step == base.model_flops_per_step  # MFU does not credit recomputation


def test_sharding_divides_model_states():
    job = tiny_job("train.global_batch=64", "train.micro_batch=8")
    by = {c.strategy: c for c in plan(job, PlanRequest(accelerator="H100-SXM", count=8)).candidates}
    assert by["zero1"].memory.optimizer == pytest.approx(by["ddp"].memory.optimizer / 8)
    assert by["fsdp"].memory.weights == pytest.approx(by["ddp"].memory.weights / 8)


def test_calibration_changes_the_plan(tmp_path):
    job = tiny_job(f"plan.calibration_dir={tmp_path}")
    request = PlanRequest(accelerator="H100-SXM", count=1, strategies=("ddp",))
    before = plan(job, request).candidates[0]
    save_calibration(
        Calibration(
            accelerator="H100-SXM",
            efficiency=before.efficiency / 2,
            mfu=0.1,
            peak_flops=989e12,
            overhead_s=0.0,
            steps=3,
            measured_at="2026-01-01T00:00:00+00:00",
            config={},
        ),
        str(tmp_path),
    )
    after = plan(job, request).candidates[0]
    assert after.calibrated and not before.calibrated
    assert after.compute_s == pytest.approx(2 * before.compute_s)
    (tmp_path / "H100-SXM.json").write_text("{not json")
    with pytest.raises(PetatrainError, match="unreadable"):
        load_calibrations(str(tmp_path))


# --- CLI ----------------------------------------------------------------------------------


def test_cli_plan_json_and_errors(tmp_path):
    result = run_cli("plan", str(ROOT / "examples" / "plan-70b.yaml"), "--accelerator", "h100-sxm", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert {c["accelerator"] for c in report["candidates"]} == {"H100-SXM"}
    assert report["recommended"]["accelerator"] == "H100-SXM"
    # The rest in this process (the subprocess above shows what a user's shell gets).
    bad = _invoke("plan", "--accelerator", "TPUv9")
    assert bad.exit_code != 0 and "not in the catalog" in bad.stderr and "Traceback" not in bad.stderr
    human = _invoke("plan", str(ROOT / "examples" / "plan-70b.yaml"), "--deadline", "2000")
    assert human.exit_code == 0 and "recommended" in human.stdout
    impossible = _invoke("plan", str(ROOT / "examples" / "plan-70b.yaml"), "--deadline", "1")
    assert impossible.exit_code == 1 and "no candidate" in impossible.stderr


def _invoke(*args: str):
    from typer.testing import CliRunner

    from petatrain.cli import app

    return CliRunner().invoke(app, list(args), env={"PETATRAIN_DEBUG": None}, catch_exceptions=False)


@pytest.mark.parametrize("verb", ["plan", "profile"])
def test_plan_verbs_have_help(verb):
    result = _invoke(verb, "--help")
    assert result.exit_code == 0 and "Usage" in result.stdout


def test_pipeline_candidates_are_searched_hybrids():
    """plan models a pipeline as P stages x D replicas, with the micro-batch count and the recompute
    policy searched, and says why it beats or loses to FSDP on the same devices."""
    from petatrain import config as config_mod
    from petatrain.plan.recommend import PlanRequest, plan

    cfg = config_mod.load("examples/plan-70b.yaml", [])
    result = plan(cfg, PlanRequest(accelerator="H100-SXM", count=64, strategies=("fsdp", "pipeline")))
    pipe = next(c for c in result.candidates if c.strategy == "pipeline")
    shape = pipe.layout
    assert shape["stages"] * shape["replicas"] == 64 and shape["stages"] >= 2
    assert shape["microbatches"] % shape["stages"] == 0 and shape["recompute"] in ("none", "selective", "full")
    assert shape["data"] in ("ddp", "fsdp")
    assert cfg.train.global_batch == shape["replicas"] * shape["microbatches"] * shape["micro_batch"]
    why = result.pipeline_vs_fsdp["H100-SXM x64"]
    assert why.startswith(f"pipeline {shape['stages']}x{shape['replicas']}") and "fsdp" in why
    # The search is over layouts: no fitting one is faster than the one chosen.
    from petatrain.plan.catalog import find, load_catalog
    from petatrain.plan.recommend import _best_pipeline

    again = _best_pipeline(result.workload, find("H100-SXM", load_catalog(cfg.plan)), 64, cfg, None, 24.0)
    assert again.layout == shape and again.step_time_s == pytest.approx(pipe.step_time_s)


def test_fsdp_replicas_of_a_stage_split_its_optimizer_state():
    """P stages x D replicas: under data fsdp a stage's optimizer state and master weights are split
    D ways, its gathered weights and whole gradients held through the step; the traffic is DDP's."""
    from petatrain import config as config_mod
    from petatrain.cost.workload import Workload
    from petatrain.train.strategies.pipeline import Pipeline

    w = Workload.from_config(config_mod.load("examples/plan-70b.yaml", []))
    ddp, fsdp = Pipeline(4, "ddp").state_layout(w, 32, 8), Pipeline(4, "fsdp").state_layout(w, 32, 8)
    assert fsdp.optimizer == pytest.approx(ddp.optimizer / 8) and fsdp.weights == pytest.approx(ddp.weights / 8)
    assert fsdp.gradients == ddp.gradients and fsdp.buffers == pytest.approx(w.gathered_width * w.params / 4)
    args = {"compute_s": 1.0, "accumulation": 8, "bandwidth": 1e11}
    assert Pipeline(4, "fsdp").communication_s(w, 32, **args) == Pipeline(4, "ddp").communication_s(w, 32, **args)


def test_plan_tables_are_whole_in_a_ci_log_and_one_block_a_row_on_a_narrow_terminal():
    """Without a terminal (a pipe, a CI log) a table is as wide as its values, no cell cut at 80
    columns and no line wrapped; on an 80-column terminal the candidates are a block each,
    `column: value` a line. The spot goodput and time are in the table, not only in --json."""
    import os
    import pty
    import sys

    piped = run_cli("plan", "examples/plan-70b.yaml", "--show", "3")
    assert piped.returncode == 0, piped.stderr
    assert "…" not in piped.stdout and "goodput spot" in piped.stdout and "time spot" in piped.stdout
    assert any(len(line) > 120 for line in piped.stdout.splitlines())  # whole, not cut to 80

    pid, fd = pty.fork()
    if pid == 0:  # the child: petatrain on an 80-column terminal
        os.chdir(ROOT)
        os.environ.update(COLUMNS="80", LINES="50", TERM="dumb")
        os.execv(sys.executable, [sys.executable, "-m", "petatrain", "plan", "examples/plan-70b.yaml", "--show", "2"])
    shown = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.waitpid(pid, 0)
    text = shown.decode(errors="replace").replace("\r", "")
    assert "…" not in text and "  goodput spot: " in text and "  strategy: pipeline" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_plan_lays_tensor_parallelism_inside_a_node_and_says_why():
    """70B on 64 H100s: plan searches tensor-parallel degrees within the 8-GPU node (2D with FSDP or
    DDP replicas, 3D inside pipeline stages) and picks 8-way tensor parallelism x 8 FSDP replicas,
    torchtitan's layout for it; each strategy's best is explained by what it pays and what fills memory."""
    from petatrain import config as config_mod
    from petatrain.cost.workload import Workload
    from petatrain.plan.recommend import PlanRequest, plan
    from petatrain.train.strategies.tensor import Tensor

    cfg = config_mod.load("examples/plan-70b.yaml", [])
    result = plan(cfg, PlanRequest(accelerator="H100-SXM", count=64))
    best = result.recommended
    assert best is not None and best.strategy == "tensor"
    assert best.layout["tensor"] == 8 and best.layout["replicas"] == 8 and best.layout["data"] == "fsdp"
    assert "parallel.tensor=8" in best.layout["settings"] and "parallel.strategy=fsdp" in best.layout["settings"]
    lines = result.layouts["H100-SXM x64"]
    tensor_line = next(line for line in lines if line.startswith("tensor 8x8"))
    assert "tensor-parallel collectives" in tensor_line and "most of it activations" in tensor_line
    assert any(line.startswith("fsdp: ") and "gathers and reduce-scatters" in line for line in lines)
    # Every degree tried stays within a node; 16 would cross one.
    tensors = [c for c in result.candidates if c.strategy == "tensor"]
    assert all(c.layout["tensor"] <= 8 for c in tensors)
    # Splitting 8 ways divides the model states and activations 8 ways.
    w = Workload.from_config(cfg)
    one, eight = Tensor(1, "ddp").state_layout(w, 8, 1), Tensor(8, "ddp").state_layout(w, 8, 1)
    assert eight.weights == pytest.approx(one.weights / 8) and eight.activation_shards == 8
    assert Tensor(3, "ddp").infeasible(w, 6).startswith("model.n_head 64 is not divisible")
