"""Pipeline parallelism end to end on Ray: the same training as DDP, and faults recovered bit-identically."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from helpers import sha256, tiny, train

pytestmark = pytest.mark.slow

PIPELINE = [
    "parallel.strategy=pipeline",
    "parallel.pipeline.stages=2",
    "parallel.pipeline.microbatches=4",
    "parallel.pipeline.partition=parameters",
]


def _losses(run_dir) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in lines if e["event"] == "step"}


@pytest.fixture(scope="module")
def pipeline_run(token_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipeline")
    traced = ["observe.profile_at=29", "observe.profile_steps=5"]  # torch.profiler over steps 29-30: the run's end
    summary = train(tiny(token_dataset, *PIPELINE, *traced), run_dir)
    assert summary["attempts"] == 1 and summary["failures"] == []
    return run_dir


def test_a_pipeline_trains_as_ddp_does(pipeline_run, baseline):
    """Same config and seed, 2 stages x 1 replica against DDP on 2 ranks: the same losses, step for step."""
    pp, ddp = _losses(pipeline_run), _losses(baseline)
    assert sorted(pp) == sorted(ddp) == list(range(1, 31))
    assert max(abs(pp[s] - ddp[s]) for s in pp) < 1e-5


def test_the_report_has_a_stage_table(pipeline_run):
    """Each stage's compute and idle share, and the bubble beside the schedule's theory."""
    from petatrain.observe.goodput import account
    from petatrain.observe.ledger import read_events

    p = account(read_events(str(pipeline_run))).pipeline
    assert p is not None and p["schedule"] == "1f1b" and p["bubble_theory"] == pytest.approx(1 / 5)
    stages = p["stages_measured"]
    # the first of three windows (its set-up) left out
    assert [s["rank"] for s in stages] == [0, 1] and all(s["steps"] == 20 for s in stages)
    assert stages[0]["units"][0].startswith("first..") and stages[1]["units"][0].endswith("..last")
    assert all(0 < s["busy_s"] < s["wall_s"] and 0 < s["idle_share"] < 1 for s in stages)
    assert all(0 < s["reduce_s"] < s["wall_s"] for s in stages)  # the tied weights' sum, between the two ranks
    # memory: weights, gradients and AdamW's two moments (gradients dropped after the step or not), and
    # the activations the schedule held at once; without a layer profile, nothing predicted
    assert all(3 * s["param_bytes"] <= s["state_bytes"] <= 4 * s["param_bytes"] for s in stages), stages
    assert all(s["activation_bytes"] > 0 and s["memory_error"] is None for s in stages)


def test_a_traced_step_says_where_its_time_went_on_every_rank(pipeline_run):
    """observe.profile_at: each rank's torch.profiler trace of the steps (Chrome's format) and its
    summary: the step's wall time, each phase of the loop inside it, the operators' own time."""
    import gzip

    folder = pipeline_run / "traces" / "attempt-0"
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((folder / f"rank-{rank}.json.gz").read_bytes()))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"petatrain.schedule", "petatrain.optimizer", "aten::mm"} <= names
        summary = json.loads((folder / f"rank-{rank}.summary.json").read_text())
        assert (summary["rank"], summary["first_step"], summary["steps"]) == (rank, 29, 2)  # cut at train.steps
        spans = summary["spans_ms"]
        inside = ("data", "schedule", "reduce_gradients")
        assert set(spans) >= {"forward_backward", *inside, "clip", "optimizer", "flags", "flags_wait", "telemetry"}
        assert all(spans[name]["calls"] == 1 for name in ("forward_backward", "schedule", "optimizer"))
        assert sum(spans[name]["ms"] for name in inside) <= spans["forward_backward"]["ms"] < summary["step_ms"]
        assert spans["clip"]["ms"] <= spans["optimizer"]["ms"]
        assert summary["communication_self_ms"] > 0 and summary["top_self_ms"][0]["ms"] > 0
        assert (
            summary["cpu_ms"] > 0 and summary["preempted_per_step"] >= 0
        )  # the training thread: its CPU, others' turns
        # Per dimension: 1F1B's 4 sends and 4 receives a rank, the tied embedding's gradient summed
        # between the two ranks (vocabulary x d_model floats), the loop's flags over the world.
        comm = summary["communication_by_dimension"]
        assert comm["complete"] and comm["unattributed_ms"] == 0, comm
        dims = comm["dimensions"]
        assert set(dims) == {"pipeline", "tied weights", "world"}, dims
        assert dims["pipeline"]["calls"] == 8 and dims["tied weights"]["calls"] == 1
        assert dims["tied weights"]["mib"] == round(320 * 64 * 4 / 2**20, 3)
        assert all(d["ms"] > 0 for d in dims.values()) and dims["world"]["calls"] >= 1


def test_every_fault_in_a_pipeline_resumes_bit_identically(pipeline_run, token_dataset, tmp_path):
    """A stage killed, one raising, one preempted (zero steps lost), one hung (its peer blocked in a
    receive: the watchdog ends it, not the collective timeout), a NaN loss in the last stage rolled
    back to the step-20 checkpoint (faults.nonfinite: rollback; a skipped one: the next test) and
    storage errors under the step-30 checkpoint: the final weights equal the uninterrupted run's, bit
    for bit. Four restarts count against faults.max_restarts (a preemption does not)."""
    specs = ["kill@step=4,rank=1", "raise@step=8,rank=0", "preempt@step=13,rank=1", "hang@step=18,rank=0"]
    specs += ["storage@step=24,rank=1,count=3", "nan@step=27,rank=1"]
    cfg = tiny(token_dataset, *PIPELINE, "faults.nonfinite=rollback", "faults.max_restarts=4")
    summary = train(cfg, tmp_path, *specs)
    causes = ["kill", "exception", "preempt", "hang", "nonfinite"]
    assert [f.cause for f in summary.failures] == causes, summary.failures
    assert sha256(tmp_path / "final" / "model.safetensors") == sha256(pipeline_run / "final" / "model.safetensors")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    preempted = next(e["attempt"] for e in events if e["event"] == "failure" and e["cause"] == "preempt")
    last = max(e["step"] for e in events if e["event"] == "step" and e["attempt"] == preempted)
    resumed = next(e["step"] for e in events if e["event"] == "resume" and e["attempt"] == preempted + 1)
    assert resumed == last == 14, "a preemption's checkpoint is the step it stopped at"
    hang = next(e for e in events if e["event"] == "failure" and e["cause"] == "hang")
    fired = next(e for e in events if e["event"] == "fault_injected" and e["fault"] == "hang")
    assert hang["t"] - fired["t"] < 6 + 5, "found by the watchdog within faults.hang_timeout_s"


def test_a_nonfinite_step_in_one_stage_is_skipped_by_all(token_dataset, tmp_path):
    """NaN gradients in the first stage: the pipeline-wide norm is NaN on every rank, so every stage
    drops the update (a rollback, where every stage resumes from the checkpoint: the every-fault run)."""
    summary = train(tiny(token_dataset, *PIPELINE), tmp_path, "nan@step=5,rank=0")
    assert summary["failures"] == []
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["action"]) for e in events if e["event"] == "nonfinite"] == [(6, "skip")]
    assert all(e["loss"] is not None for e in events if e["event"] == "step" and e["step"] > 6)


def _from_checkpoint(run_dir, to, step: int):
    """A copy of `run_dir` as it was when checkpoint `step` was its newest (later ones and the final weights gone)."""
    shutil.copytree(run_dir, to)
    for folder in (to / "checkpoints").iterdir():
        if int(folder.name.removeprefix("step-")) > step:
            shutil.rmtree(folder)
    shutil.rmtree(to / "final")
    return to


@pytest.mark.parametrize("direction", ["pipeline -> ddp", "ddp -> pipeline"])
def test_resume_at_another_strategy(direction, pipeline_run, baseline, token_dataset, tmp_path):
    """A checkpoint saved by 2 pipeline stages resumes on 2 DDP ranks and back: state is saved per
    named parameter and the loader's position is global, so the steps after it are the same steps."""
    source, target = (pipeline_run, baseline) if direction == "pipeline -> ddp" else (baseline, pipeline_run)
    overrides = [] if direction == "pipeline -> ddp" else PIPELINE
    run_dir = _from_checkpoint(source, tmp_path / "run", 20)
    summary = train(tiny(token_dataset, *overrides), run_dir)
    assert summary["failures"] == []  # the run's second driver continued it without a fault
    resumed, reference = _losses(run_dir), _losses(target)
    assert max(abs(resumed[s] - reference[s]) for s in range(21, 31)) < 1e-5
    ours = load_file(run_dir / "final" / "model.safetensors")
    theirs = load_file(target / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-5


def test_two_replicas_of_two_stages_train_alike_and_resume_as_one(pipeline_run, token_dataset, tmp_path):
    """2 stages x 2 replicas on Ray (4 ranks sharing 2 CPUs), each stage's replicas under FSDP,
    train as 2 x 1 does; its checkpoint of step 20 (each stage's shards gathered whole) resumes on
    2 x 1 without FSDP: another data-parallel degree, the same next steps."""
    wide = [*PIPELINE, "parallel.workers=4", "resources.cpus_per_worker=0.5", "parallel.pipeline.data=fsdp"]
    summary = train(tiny(token_dataset, *wide), tmp_path / "wide")
    assert summary["attempts"] == 1
    two_by_two, reference = _losses(tmp_path / "wide"), _losses(pipeline_run)
    assert max(abs(two_by_two[s] - reference[s]) for s in reference) < 1e-5
    run_dir = _from_checkpoint(tmp_path / "wide", tmp_path / "narrow", 20)
    train(tiny(token_dataset, *PIPELINE), run_dir)
    resumed = _losses(run_dir)
    assert max(abs(resumed[s] - reference[s]) for s in range(21, 31)) < 1e-5
    ours = load_file(run_dir / "final" / "model.safetensors")
    theirs = load_file(pipeline_run / "final" / "model.safetensors")
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-5


def test_two_stages_resume_as_four(pipeline_run, token_dataset, tmp_path):
    """A checkpoint of 2 stages resumes on 4 (each unit of the tiny GPT a stage of its own): the
    parameters are saved by name, so each new stage loads the ones it keeps."""
    run_dir = _from_checkpoint(pipeline_run, tmp_path / "run", 20)
    four = [*PIPELINE, "parallel.pipeline.stages=4", "parallel.workers=4", "resources.cpus_per_worker=0.5"]
    train(tiny(token_dataset, *four), run_dir)
    resumed, reference = _losses(run_dir), _losses(pipeline_run)
    assert max(abs(resumed[s] - reference[s]) for s in range(21, 31)) < 1e-5
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in events if e["event"] == "pipeline_stage" and e["stages"] == 4} == {0, 1, 2, 3}


def test_fsdp_and_pipeline_checkpoints_resume_in_each_other(pipeline_run, baseline, token_dataset, tmp_path):
    """FSDP on 2 ranks trains as DDP does; its checkpoint (each rank a chunk of the rows) resumes as 2
    pipeline stages, and a pipeline's checkpoint resumes under FSDP: the same next steps either way."""
    fsdp = ["parallel.strategy=fsdp"]
    train(tiny(token_dataset, *fsdp), tmp_path / "fsdp")
    sharded, reference = _losses(tmp_path / "fsdp"), _losses(baseline)
    assert max(abs(sharded[s] - reference[s]) for s in reference) < 1e-5
    for source, overrides, name in [(tmp_path / "fsdp", PIPELINE, "to-pipeline"), (pipeline_run, fsdp, "to-fsdp")]:
        run_dir = _from_checkpoint(source, tmp_path / name, 20)
        summary = train(tiny(token_dataset, *overrides), run_dir)
        assert summary["failures"] == []  # the run's second driver continued it without a fault
        resumed = _losses(run_dir)
        assert max(abs(resumed[s] - reference[s]) for s in range(21, 31)) < 1e-5, name
        ours = load_file(run_dir / "final" / "model.safetensors")
        theirs = load_file(baseline / "final" / "model.safetensors")
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) < 1e-5, name


@pytest.mark.chaos
def test_a_stage_node_partitioned_shrinks_the_replicas_and_they_grow_back(token_dataset, tmp_path):
    """2 stages x 2 replicas on two Ray nodes in network namespaces (2 ranks a node). The worker
    node's link is cut at step 8: the node is lost in seconds and training goes on as 2 stages x 1
    replica on the head node (parallel.workers 2-4). A fresh worker node joins: the driver sees room
    for 4 again, the ranks stop together after a checkpoint (no step lost) and 2 x 2 resumes from it;
    a few steps later the driver's program ends the run (TrainJob.stop)."""
    from helpers import partitioned_and_grown_back

    partitioned_and_grown_back([*PIPELINE, f"data.dataset={token_dataset}"], tmp_path / "run")
