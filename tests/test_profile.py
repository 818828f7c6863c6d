"""`petatrain profile`: real steps measured, each figure beside the plan's estimate, a calibration plan uses."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from petatrain import config as config_mod
from petatrain.cost.calibration import load_calibrations
from petatrain.plan.profile import catalog_name, profile


def small_job(tmp_path, *overrides: str):
    return config_mod.load(
        None,
        [
            "model.n_layer=2",
            "model.d_model=64",
            "model.n_head=2",
            "model.seq_len=64",
            "train.global_batch=16",
            "train.micro_batch=8",
            f"plan.calibration_dir={tmp_path}",
            *overrides,
        ],
    )


def test_profile_measures_compares_and_calibrates(tmp_path):
    report = profile(small_job(tmp_path), steps=2)
    rows = {r["figure"]: r for r in report["comparison"]}
    # Memory: estimate vs torch's MemTracker on this very run (two micro-batches: gradients accumulate).
    assert abs(rows["peak memory (tensors)"]["error"]) < 0.10
    # FLOPs: the analytic count vs the dispatch-level counter.
    assert abs(rows["executed FLOPs per step"]["error"]) < 0.01
    split = report["measured"]["time_split_s"]
    assert set(split) == {"data_wait", "forward", "backward", "optimizer", "communication"}
    assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer"] > 0
    assert sum(split.values()) <= report["measured"]["step_time_s"] * 1.05
    assert report["verdict"] in {"compute-bound", "memory-bound", "communication-bound", "data-bound"}
    assert report["accumulation"] == 2 and report["estimate"]["calibrated"] is False
    cal = load_calibrations(str(tmp_path))["cpu"]
    assert 0 < cal.efficiency <= 1 and cal.steps == 2
    # The next run's estimate uses what the first one measured.
    again = profile(small_job(tmp_path), steps=2)
    assert again["estimate"]["calibrated"] is True
    assert again["estimate"]["efficiency"] == pytest.approx(cal.efficiency)


def test_a_tensor_parallel_profile_measures_each_layers_collectives_and_plan_uses_their_bandwidth(tmp_path):
    """parallel.tensor 2: the collectives of each block, as the built-in GPT's plan issues them (sequence
    parallel: an all-gather and a reduce-scatter of a micro-batch's activations around the attention
    and around the MLP), timed on 2 gloo processes; the calibration keeps their bus bandwidth and
    plan's tensor-parallel groups on that accelerator get it instead of the catalog's link."""
    from petatrain.plan import catalog
    from petatrain.plan.recommend import intra_bandwidth

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("on a GPU host the collectives are measured with NCCL, one GPU a rank: needs 2 CUDA devices")
    cfg = small_job(tmp_path, "parallel.tensor=2")
    report = profile(cfg, steps=2)
    tp = report["tensor_collectives"]
    act = 8 * 64 * 64 * 4  # micro-batch x seq_len x d_model x fp32: one micro-batch's activations
    assert [name for name in tp["layers"] if name.startswith("layer")] == ["layer 0", "layer 1"]
    for name in ("layer 0", "layer 1"):
        forward = tp["layers"][name]["forward"]
        assert {op: k["count"] for op, k in forward.items()} == {
            "all_gather_into_tensor": 2,
            "reduce_scatter_tensor": 2,
        }
        assert all(k["bytes"] == 2 * act and k["seconds"] > 0 for k in forward.values())
    # Backward, their transposes: the gradients reduce-scattered back to the positions' split, not
    # all-reduced (a local tensor between the blocks' parts made them all-reduces: twice the bytes).
    backward = tp["layers"]["layer 1"]["backward"]
    assert {op: k["count"] for op, k in backward.items()} == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert tp["bus_bandwidth"] > 0 and tp["seconds_per_micro_batch"] > 0
    assert tp["planned_bus_bytes_per_micro_batch"] == (2 * 4 + 2) * act  # 2 (n-1)/n = 1 on 2 ranks
    assert 0.8 < tp["planned_over_measured_bytes"] < 1.25
    (row,) = [r for r in report["comparison"] if r["figure"] == "tensor-parallel collectives per micro-batch"]
    assert row["estimate"] is None  # no bandwidth known yet for the CPU: nothing to estimate with
    cal = load_calibrations(str(tmp_path))["cpu"]
    assert cal.tensor_bus_bandwidth == pytest.approx(tp["bus_bandwidth"])
    h100 = catalog.load_catalog(cfg.plan)["H100-SXM"]
    assert intra_bandwidth(h100, cal) == cal.tensor_bus_bandwidth
    assert intra_bandwidth(h100, None) == pytest.approx(0.8 * h100.intra_link_gb_s_per_direction * 1e9)


def test_profile_cli_json(tmp_path):
    result = run_cli(
        "profile", "--steps", "1", "--json", "--set", f"plan.calibration_dir={tmp_path}", "--set", "model.seq_len=32"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["calibration_path"].startswith(str(tmp_path))
    assert report["measured"]["peak_memory_bytes"] > 0


def test_gpu_names_map_to_the_catalog():
    assert catalog_name("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert catalog_name("NVIDIA H100 PCIe") == "H100-PCIe"
    assert catalog_name("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert catalog_name("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert catalog_name("NVIDIA L40S") == "L40S" and catalog_name("NVIDIA L4") == "L4"
    assert catalog_name("Some FPGA") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("train", [{}, {"activation_checkpointing": "full"}, {"precision": "bf16-mixed"}])
def test_profile_on_gpu_memory_within_5_percent(tmp_path, train):
    overrides = [f"train.{k}={v}" for k, v in train.items()]
    report = profile(small_job(tmp_path, "model.n_layer=4", "model.d_model=512", "model.n_head=8", *overrides), steps=3)
    rows = {r["figure"]: r for r in report["comparison"]}
    assert abs(rows["peak memory (tensors)"]["error"]) < 0.05


def test_a_calibration_from_steps_that_spread_is_not_saved_and_an_estimate_says_its_source(tmp_path):
    """A busy machine's steps spread: past plan.calibration_max_spread the calibration is not saved
    (the next profile would compare against noise, +933% as a user saw); an estimate says where its
    efficiency comes from, the catalog or the calibration file (its date, steps and spread)."""
    noisy = profile(small_job(tmp_path, "plan.calibration_max_spread=0"), steps=4)
    assert noisy["measured"]["step_time_spread"] > 0 and noisy["calibration_path"] is None
    assert noisy["calibration_refused"].startswith("not saved: the timed steps spread")
    assert load_calibrations(str(tmp_path)) == {} and noisy["estimate"]["calibration_source"].startswith("the catalog")
    kept = profile(small_job(tmp_path, "plan.calibration_max_spread=100"), steps=4)
    cal = load_calibrations(str(tmp_path))["cpu"]
    assert kept["calibration_path"] == cal.path and cal.spread == pytest.approx(kept["measured"]["step_time_spread"])
    source = profile(small_job(tmp_path), steps=1, save=False)["estimate"]["calibration_source"]
    assert source.startswith(f"{cal.path} (measured {cal.measured_at}, 4 steps, spread ")
