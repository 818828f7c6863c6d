"""Goodput accounting, the run report, `petatrain report` and the metrics endpoint, on
synthetic ledgers whose every second is known, so the expected numbers are exact."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import run_cli
from petatrain.errors import PetatrainError
from petatrain.observe.goodput import account
from petatrain.observe.ledger import EventLog, read_events
from petatrain.observe.metrics import MetricsServer
from petatrain.observe.report import write_report
from petatrain.storage import read_bytes

T0 = 1000.0
approx = lambda value: pytest.approx(value, abs=1e-6)  # noqa: E731


class Script:
    """Writes a ledger the way the training loop would, on a clock the test moves."""

    def __init__(self, run_url: str):
        self.log = EventLog(run_url)
        self.now = T0

    def emit(self, event: str, after: float = 0.0, **fields):
        self.now += after
        return self.log.emit(event, t=self.now, **fields)

    def start(self, steps: int):
        self.emit("run_start", run_id="test-run", workers=[2, 2], steps=steps, config={})
        self.emit("attempt_start", attempt=0, world_size=2)
        for rank in range(2):
            self.emit("worker_start", attempt=0, rank=rank, pid=100 + rank, node="n0")

    def steps(self, attempt: int, first: int, last: int, step_s: float = 1.0, wait: float = 0.1):
        for step in range(first, last + 1):
            self.emit(
                "step",
                after=step_s,
                attempt=attempt,
                step=step,
                step_s=step_s,
                data_wait_s=wait,
                loss=10.0 / step,
                lr=1e-3,
                tokens=1024,
                grad_norm=1.0,
            )

    def checkpoint(self, attempt: int, step: int, stall: float):
        self.emit("checkpoint_snapshot", after=stall, attempt=attempt, step=step, stall_s=stall)
        url = f"run/checkpoints/step-{step:08d}"
        self.emit("checkpoint_commit", attempt=attempt, step=step, write_s=1.25, bytes=4096, url=url)

    def restart(self, attempt: int, reason: str, after: float, resume_after: float, next_step: int):
        self.emit("restart", after=after, attempt=attempt, world_size=2, reason=reason)
        self.emit("attempt_start", attempt=attempt, world_size=2)
        self.emit("resume", after=resume_after, attempt=attempt, step=next_step, checkpoint="ckpt")

    def close(self):
        self.log.close()


def until_kill(run_dir) -> Script:
    """Start-up 2 s; steps 1-10 end at 12; snapshot stall 0.5; steps 11-17 end at 19.5; rank 1
    killed (injected) at 19.7."""
    s = Script(str(run_dir))
    s.start(steps=20)
    s.now += 2.0
    s.steps(0, 1, 10)
    s.checkpoint(0, 10, stall=0.5)
    s.steps(0, 11, 17)
    s.emit("fault_injected", after=0.2, attempt=0, fault="kill", step=17, rank=1)
    return s


def kill_run(run_dir) -> Script:
    """Killed at step 17 (rank 1) after a checkpoint at step 10; resumed at step 11; 20 steps.

    Timeline (s since start): `until_kill`; the kill noticed at 22.7; restart; resume at 25;
    step 11 takes 1.5 s (starts at 25.5, ends at 27); steps 12-20 end at 36; end at 36.5.
    """
    s = until_kill(run_dir)
    s.emit("failure", after=3.0, attempt=0, cause="kill", detail="rank 1 exited with SIGKILL", rank=1)
    s.restart(1, "kill", after=0.3, resume_after=2.0, next_step=11)
    s.emit("step", after=2.0, attempt=1, step=11, step_s=1.5, data_wait_s=0.1, loss=10 / 11, tokens=1024)
    s.steps(1, 12, 20)
    s.emit("eval", attempt=1, step=20, loss=0.55)
    s.emit("end", after=0.5, status="ok", step=20, detail="", final="run/final/model.safetensors")
    s.close()
    return s


def test_clean_run_is_all_productive_but_waits_stalls_and_start_up(tmp_path):
    s = Script(str(tmp_path))
    s.start(steps=20)
    s.now += 1.0
    s.steps(0, 1, 10, step_s=0.5, wait=0.05)
    s.checkpoint(0, 10, stall=0.2)
    s.steps(0, 11, 20, step_s=0.5, wait=0.05)
    s.emit("end", after=0.3, status="ok", step=20, detail="", final="f")
    s.close()

    g = account(read_events(str(tmp_path)))
    assert g.status == "ok" and g.run_id == "test-run" and g.attempts == 1
    assert g.wall_s == approx(11.5)
    assert g.time_split() == {
        "productive_s": approx(9.0),
        "data_wait_s": approx(1.0),
        "checkpoint_stall_s": approx(0.2),
        "fault_detection_s": approx(0.0),
        "restart_s": approx(0.0),
        "recomputed_s": approx(0.0),
        "startup_s": approx(1.0),  # run_start -> the first step
        "finish_s": approx(0.3),  # the last step -> the end: the final save
        "idle_s": approx(0.0),
    }
    assert g.goodput == approx(9.0 / 11.5)
    assert g.faults == [] and g.steps_kept == 20 and g.steps_recomputed == 0 and g.note == ""
    assert g.tokens_kept == 20 * 1024
    assert [c.step for c in g.checkpoints] == [10] and g.checkpoints[0].committed


def test_kill_after_checkpoint_recomputes_the_lost_steps(tmp_path):
    kill_run(tmp_path)
    g = account(read_events(str(tmp_path)))

    assert g.wall_s == approx(36.5)
    assert g.time_split() == {
        "productive_s": approx(18.5),  # 20.5 s of kept steps minus 2.0 s of data wait
        "data_wait_s": approx(2.0),
        "checkpoint_stall_s": approx(0.5),
        "fault_detection_s": approx(3.0),  # injected at 19.7, failure at 22.7
        "restart_s": approx(2.8),  # failure at 22.7 -> step 11 of attempt 1 starts at 25.5
        "recomputed_s": approx(7.0),  # steps 11-17 of attempt 0
        "startup_s": approx(2.0),
        "finish_s": approx(0.5),  # the final save
        "idle_s": approx(0.2),  # between the last step of attempt 0 and the kill
    }
    assert sum(g.time_split().values()) == approx(g.wall_s)
    assert g.goodput == approx(18.5 / 36.5)
    assert g.steps_kept == 20 and g.steps_recomputed == 7 and g.last_step == 20 and g.attempts == 2
    (fault,) = g.faults
    assert fault.to_dict() == {
        "cause": "kill",
        "rank": 1,
        "attempt": 0,
        "step": 17,
        "t_s": approx(22.7),
        "detected_after_s": approx(3.0),
        "recovered_after_s": approx(4.3),  # to the end of the first step of attempt 1
        "restart_s": approx(2.8),
        "steps_lost": 7,
        "detail": "rank 1 exited with SIGKILL",
    }
    # The loss curve holds each step once, from the attempt whose result was kept.
    assert [step for step, _ in g.loss_curve] == list(range(1, 21))
    lost = sorted(p.step for p in g.timeline if not p.kept)
    assert lost == list(range(11, 18)) and all(p.attempt == 0 for p in g.timeline if not p.kept)
    assert g.evals == [{"step": 20, "loss": 0.55, "attempt": 1, "t_s": approx(36.0)}]


def test_waiting_for_rank_0s_checkpoint_write_counts_as_restart_not_detection(tmp_path):
    """The kill run, but Ray Train's shutdown first let rank 0 finish a checkpoint for 1.5 s
    (22.7 -> 24.2, the drain event written at its end, the failure event after it)."""
    s = until_kill(tmp_path)
    s.emit("checkpoint_drain", after=4.5, attempt=0, lost=[1], waited_s=1.5, done=True, committed=10)
    s.emit("failure", after=0.1, attempt=0, cause="kill", detail="rank 1 exited with SIGKILL", rank=1)
    s.emit("restart", after=0.3, attempt=1, world_size=2, reason="kill")
    s.emit("attempt_start", attempt=1, world_size=2)
    s.emit("resume", after=0.6, attempt=1, step=11, checkpoint="ckpt")
    s.emit("step", after=2.0, attempt=1, step=11, step_s=1.5, data_wait_s=0.1, loss=10 / 11, tokens=1024)
    s.steps(1, 12, 20)
    s.emit("end", after=0.5, status="ok", step=20, detail="", final="f")
    s.close()

    g = account(read_events(str(tmp_path)))
    (fault,) = g.faults
    assert fault.t_s == approx(22.7)  # decided when the drain began, not when the failure was written
    assert fault.detected_after_s == approx(3.0)
    assert fault.restart_s == approx(3.0)  # 1.5 s of drain, 0.1 to the failure event, 1.4 to step 11's start
    assert g.time_split()["fault_detection_s"] == approx(3.0)
    assert g.time_split()["restart_s"] == approx(3.0)
    assert sum(g.time_split().values()) == approx(g.wall_s)


def test_hang_is_charged_detection_time_until_the_watchdog_fires(tmp_path):
    s = Script(str(tmp_path))
    s.start(steps=50)
    s.now += 1.0
    s.steps(0, 1, 30, wait=0.0)
    s.checkpoint(0, 30, stall=0.5)
    s.steps(0, 31, 40, wait=0.0)
    s.emit("fault_injected", after=0.3, attempt=0, fault="hang", step=40, rank=1)  # fires after its step
    s.emit("failure", after=30.0, attempt=0, cause="hang", detail="no progress within 30 s", rank=None)
    s.restart(1, "hang", after=1.0, resume_after=1.0, next_step=31)
    s.steps(1, 31, 50, wait=0.0)
    s.emit("end", after=0.2, status="ok", step=50, detail="", final="f")
    s.close()

    g = account(read_events(str(tmp_path)))
    (fault,) = g.faults
    assert fault.cause == "hang" and fault.step == 40 and fault.rank == 1  # rank from the injection
    assert fault.detected_after_s == approx(30.0)  # injected at 41.8, the watchdog fired at 71.8
    assert fault.steps_lost == 10
    assert fault.restart_s == approx(2.0) and fault.recovered_after_s == approx(3.0)
    assert g.wall_s == approx(94.0)
    assert g.time_split() == {
        "productive_s": approx(50.0),
        "data_wait_s": approx(0.0),
        "checkpoint_stall_s": approx(0.5),
        "fault_detection_s": approx(30.0),
        "restart_s": approx(2.0),
        "recomputed_s": approx(10.0),  # steps 31-40 of attempt 0
        "startup_s": approx(1.0),
        "finish_s": approx(0.2),
        "idle_s": approx(0.3),  # the hung step 41's 0.3 s before the fault fired
    }


def test_preempt_checkpoints_at_the_step_boundary_and_loses_nothing(tmp_path):
    s = Script(str(tmp_path))
    s.start(steps=30)
    s.now += 1.0
    s.steps(0, 1, 22, wait=0.0)
    s.emit("fault_injected", after=0.4, attempt=0, fault="preempt", step=23, rank=1)  # notice during step 23
    s.emit("step", after=0.6, attempt=0, step=23, step_s=1.0, data_wait_s=0.0, loss=0.4, tokens=1024)
    s.checkpoint(0, 23, stall=0.5)
    s.emit("failure", after=1.5, attempt=0, cause="preempt", detail="SIGTERM", rank=1)
    s.restart(1, "preempt", after=0.5, resume_after=1.0, next_step=24)
    s.emit("step", after=1.5, attempt=1, step=24, step_s=1.0, data_wait_s=0.0, loss=0.4, tokens=1024)
    s.steps(1, 25, 30, wait=0.0)
    s.emit("end", after=0.5, status="ok", step=30, detail="", final="f")
    s.close()

    g = account(read_events(str(tmp_path)))
    (fault,) = g.faults
    assert fault.cause == "preempt" and fault.step == 23
    assert fault.steps_lost == 0 and g.recomputed_s == 0.0 and g.steps_recomputed == 0
    # Step 23 and its snapshot happened after the notice: only the 1.5 s after the snapshot is detection.
    assert fault.detected_after_s == approx(1.5)
    assert fault.restart_s == approx(2.0) and fault.recovered_after_s == approx(3.0)
    assert g.time_split() == {
        "productive_s": approx(30.0),
        "data_wait_s": approx(0.0),
        "checkpoint_stall_s": approx(0.5),
        "fault_detection_s": approx(1.5),
        "restart_s": approx(2.0),
        "recomputed_s": approx(0.0),
        "startup_s": approx(1.0),
        "finish_s": approx(0.5),
        "idle_s": approx(0.0),
    }
    assert g.wall_s == approx(35.5)


def test_failed_run_with_torn_last_line(tmp_path):
    s = Script(str(tmp_path))
    s.start(steps=100)
    s.steps(0, 1, 5)
    s.emit("failure", after=2.0, attempt=0, cause="exception", detail="ValueError: boom", rank=0)
    s.emit("end", after=0.1, status="failed", step=5, detail="restart budget spent", final=None)
    s.close()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"t": 1099.0, "event": "st')  # the writer died mid-line

    g = account(read_events(str(tmp_path)))
    assert g.status == "failed" and g.wall_s == approx(7.1)
    (fault,) = g.faults
    assert fault.cause == "exception" and fault.step == 5
    assert fault.detected_after_s == approx(2.0)  # no injection: counted from the last step
    assert fault.recovered_after_s is None and fault.steps_lost is None and fault.restart_s == 0.0
    assert g.productive_s == approx(4.5) and g.finish_s == approx(0.1) and g.idle_s == approx(0.0)


def test_failure_before_the_first_step_has_no_detection_time(tmp_path):
    s = Script(str(tmp_path))
    s.start(steps=3)
    s.emit("failure", after=3.0, attempt=0, cause="exception", detail="ImportError", rank=0)
    s.restart(1, "exception", after=0.5, resume_after=0.5, next_step=1)
    s.steps(1, 1, 3)
    s.emit("end", after=0.1, status="ok", step=3, detail="", final="f")
    s.close()

    g = account(read_events(str(tmp_path)))
    (fault,) = g.faults
    assert fault.detected_after_s is None and fault.step is None and fault.steps_lost == 0
    assert fault.restart_s == approx(1.0)  # failure at 3.0 -> step 1 starts at 4.0
    # Attempt 0's 3 s before its failure were its start-up; the restart's second is counted once.
    assert g.startup_s == approx(3.0) and g.finish_s == approx(0.1) and g.idle_s == approx(0.0)
    assert g.productive_s == approx(2.7)


def test_run_in_progress_and_empty_or_odd_ledgers():
    events = [
        {"t": T0, "event": "run_start", "run_id": "r", "steps": 10},
        {"t": T0 + 2, "event": "step", "attempt": 0, "step": 1, "step_s": 1.5, "data_wait_s": 0.5},
        {"t": T0 + 3, "event": "step", "attempt": 0, "step": 2, "step_s": "oops", "data_wait_s": 0},  # wrong type
        {"t": T0 + 4, "event": "step"},  # no step number
        {"t": T0 + 4, "event": "stepp", "step": 3},  # a kind this petatrain does not know
        {"event": "step", "step": 3},  # no time: left out
    ]
    g = account(events)  # a line that fits no event only marks the time: the run was alive then
    assert (
        g.status == "running" and "in progress" in g.note and "4 ledger line(s) fit no event" in g.note
    )  # run_start too: no workers, no config
    assert g.wall_s == approx(4.0) and g.productive_s == approx(1.0) and g.data_wait_s == approx(0.5)
    assert g.steps_kept == 1 and g.goodput == approx(0.25)
    with pytest.raises(ValueError, match="schema version"):  # a newer petatrain's ledger is refused, not misread
        account([{**events[0], "v": 99}])
    empty = account([])
    assert empty.goodput == 0.0 and empty.note == "no events" and empty.to_dict()["faults"] == []


def test_parts_that_exceed_wall_time_are_reported_not_hidden():
    events = [  # step times from a clock that runs faster than the driver's
        {"t": T0, "event": "run_start"},
        {"t": T0 + 1, "event": "step", "attempt": 0, "step": 1, "step_s": 3.0, "data_wait_s": 0.0},
        {"t": T0 + 2, "event": "end", "status": "ok"},
    ]
    g = account(events)
    assert g.idle_s == 0.0 and g.goodput == approx(1.5) and "more than" in g.note


def test_report_files_and_html(tmp_path):
    kill_run(tmp_path)
    report = write_report(str(tmp_path))
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["goodput"] == approx(18.5 / 36.5) and report["restarts"] == 1
    for name in ("loss.png", "timeline.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    page = (tmp_path / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 and "<img" in page and 'src="http' not in page
    fault_table = page[page.index('<table class="faults">') :]
    fault_table = fault_table[: fault_table.index("</table>")]
    # Attempts are numbered from 1 where people read them (the console says "attempt 2 resumes").
    row = ["kill", "1", "1", "17", "22.70", "3.00", "4.30", "7", "rank 1 exited with SIGKILL"]
    assert "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" in fault_table
    assert "<td>recomputed (lost) steps</td><td>7.000</td>" in page
    # Each part of the wall time is defined where it is shown.
    assert "<td>start-up</td><td>2.000</td><td>5.5%</td><td>from a driver&#x27;s start to its first step" in page
    assert "<td>finish</td><td>0.500</td>" in page and "the final save and the report" in page


def _entry(record_id: int, group: str, name: str, t_ns: int, *sizes: int, p2p: bool = False) -> dict:
    """A flight recorder entry as torch dumps it (the fields train.trace reads)."""
    return {
        "record_id": record_id, "process_group": (str(record_id % 7), group), "profiling_name": name,
        "time_created_ns": t_ns, "input_sizes": [list(sizes)] if sizes else [], "input_dtypes": ["Float"] * bool(sizes),
        "is_p2p": p2p, "duration_ms": None,
    }  # fmt: skip


def test_each_dimensions_communication_is_told_apart_by_its_groups_threads(tmp_path, capsys):
    """gloo's events carry no group: each is matched to the flight recorder's entry issued last before it
    started (among groups whose next entry has its name), and each thread to its group by majority. A
    data-parallel all-reduce overlapping the tensor-parallel ones, an event left from before the
    window, sends and receives (a pipeline's) and the recorder's own times (NCCL) all land where they
    belong; the report shows a row per rank and dimension."""
    from petatrain import render
    from petatrain.train.trace import Work, communication_by_dimension

    ms = 1_000_000  # ns
    window = (100 * ms, 200 * ms)
    tp, dp = "mesh_tp", "mesh_dp"
    entries = [_entry(1, "default_pg", "gloo:all_reduce", 90 * ms, 3)]  # before the window: not counted
    work = [Work("gloo:all_reduce", 3, 101 * ms, 800.0)]  # a tensor-parallel one of before, still running
    for step in range(2):
        t0 = (110 + 40 * step) * ms
        entries.append(_entry(10 + 10 * step, dp, "gloo:all_reduce", t0, 1024, 256))  # a bucket: 1.25 MiB
        # on its group's two threads, 9 ms, started once the first tensor-parallel one had been issued
        work.append(Work("gloo:all_reduce", 7 + step, t0 + 3 * ms, 9000.0))
        for k in range(4):  # the tensor-parallel all-reduces, each waited for, while the bucket runs
            at = t0 + (2 + 2 * k) * ms
            entries.append(_entry(11 + 10 * step + k, tp, "gloo:all_reduce", at, 64, 64))
            work.append(Work("gloo:all_reduce", 3 + k % 2, at + 50_000, 500.0))
        entries.append(_entry(19 + 10 * step, "default_pg", "gloo:all_reduce", t0 + 20 * ms, 3))
        work.append(Work("gloo:all_reduce", 5, t0 + 20 * ms + 10_000, 100.0))
        # a tensor-parallel one issued 30 us after the flags' work started (within the clocks' slack):
        # the flags' is still the one issued before it
        entries.append(_entry(18 + 10 * step, tp, "gloo:all_reduce", t0 + 20 * ms + 40_000, 64, 64))
        work.append(Work("gloo:all_reduce", 3, t0 + 20 * ms + 60_000, 500.0))
        work += [Work("gloo:send", 1, t0 + 25 * ms, 2000.0), Work("gloo:recv", 1, t0 + 28 * ms, 1000.0)]
    out = communication_by_dimension(work, entries, window, steps=2)
    assert out["complete"] and out["unattributed_ms"] == 0
    assert out["dimensions"] == {
        "data": {"calls": 1.0, "mib": 1.0, "ms": 9.0},
        "tensor": {"calls": 5.0, "mib": 0.078, "ms": 2.9},  # 5 x 0.5 ms, and half of the one left from before
        "world": {"calls": 1.0, "mib": 0.0, "ms": 0.1},
        "pipeline": {"calls": 2.0, "mib": None, "ms": 3.0},  # gloo's sends: no sizes recorded
    }
    # A full buffer that starts inside the window dropped some; NCCL's entries carry their own time.
    timed = [e | {"duration_ms": 2.0} for e in entries[1:-1]] + entries[-1:]  # the last not yet seen to end
    out = communication_by_dimension([], timed, window, steps=2)
    assert out["dimensions"]["data"]["ms"] == 2.0 and out["dimensions"]["tensor"]["ms"] == 9.0
    assert out["timed"] == [13, 14]
    unnamed = [_entry(5, "undefined", "gloo:broadcast", 150 * ms, 8)]  # a group made without a description
    assert communication_by_dimension([], unnamed, window, steps=1)["dimensions"] == {
        "other": {"calls": 1.0, "mib": 0.0, "ms": None}
    }
    full = [_entry(1000 + i, tp, "gloo:all_reduce", 150 * ms, 4) for i in range(2000)]
    assert communication_by_dimension([], full, window, steps=1)["complete"] is False

    kill_run(tmp_path)
    comm = communication_by_dimension(work, entries, window, steps=2)
    for rank in (1, 0):
        summary = {"rank": rank, "first_step": 29, "steps": 2, "step_ms": 60.0, "communication_by_dimension": comm}
        folder = tmp_path / "traces" / "attempt-1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{rank}.summary.json").write_text(json.dumps(summary))
    (folder / "rank-2.summary.json").write_text("{")  # torn: left out, the report stands
    report = write_report(str(tmp_path))
    assert [(c["attempt"], c["rank"]) for c in report["communication"]] == [(1, 0), (1, 1)]
    page = (tmp_path / "report.html").read_text()
    row = ["2", "0", "29-30", "60.0", "tensor", "5", "0.078", "2.90", "4.8%"]
    assert "<h2>Communication by mesh dimension</h2>" in page
    assert "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" in page
    render.report(report)  # `petatrain report`'s console: a row per rank, a column per dimension
    console = capsys.readouterr().out
    assert "communication by mesh dimension" in console and "2.9 (5, 0.08)" in console, console


def _report_on_object_store(run: str) -> None:
    s = Script(run)
    s.start(steps=3)
    s.steps(0, 1, 3)
    s.emit("end", after=0.5, status="ok", step=3, detail="", final="f")
    s.close()  # an object-store ledger is uploaded whole
    report = write_report(run)
    assert report["files"]["html"] == run + "/report.html"
    assert json.loads(read_bytes(run + "/report.json")) == report
    assert read_bytes(run + "/timeline.png").startswith(b"\x89PNG")
    assert report["steps"]["kept"] == 3 and report["wall_s"] == approx(3.5)


def test_report_on_an_object_store():
    # memory:// takes the object-store paths (whole-file ledger upload, one PUT per report file) in-process.
    _report_on_object_store("memory://petatrain-test/runs/r1")


@pytest.mark.s3
def test_report_on_s3(s3_bucket):
    _report_on_object_store(f"{s3_bucket}/runs/r1")


def test_report_errors_name_what_is_missing(tmp_path):
    with pytest.raises(PetatrainError, match="run not found"):
        write_report(str(tmp_path / "nope"))
    with pytest.raises(PetatrainError, match=r"no events\.jsonl"):
        write_report(str(tmp_path))
    (tmp_path / "events.jsonl").write_text('{"t": 1, "ev')
    with pytest.raises(PetatrainError, match="no readable events"):
        write_report(str(tmp_path))


def test_cli_report(tmp_path):
    kill_run(tmp_path)
    result = run_cli("report", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["time"]["recomputed_s"] == approx(7.0)
    assert report["faults"][0]["steps_lost"] == 7 and report["files"]["html"].endswith("report.html")

    human = run_cli("report", str(tmp_path))
    assert human.returncode == 0 and "goodput 50.7%" in human.stdout and "kill" in human.stdout
    assert "report.html" in human.stdout

    (tmp_path / "empty").mkdir()
    for missing in (tmp_path / "nope", tmp_path / "empty"):
        result = run_cli("report", str(missing))
        assert result.returncode == 2
        assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_endpoint_serves_what_the_ledger_says(tmp_path):
    kill_run(tmp_path)
    events = read_events(str(tmp_path))
    with MetricsServer() as metrics, MetricsServer() as other:
        assert metrics.host == "127.0.0.1" and metrics.port > 0 and other.port != metrics.port
        for event in events:
            metrics.observe(event)
        values = _scrape(metrics.url)
        assert _scrape(other.url).get(("petatrain_step", ())) == 0.0  # a registry per server
    g = account(events)
    assert values[("petatrain_step", ())] == 20
    assert values[("petatrain_attempt", ())] == 1
    assert values[("petatrain_restarts_total", ())] == 1
    assert values[("petatrain_failures_total", (("cause", "kill"),))] == 1
    assert values[("petatrain_steps_total", ())] == 27  # 20 kept + 7 recomputed
    assert values[("petatrain_step_seconds", ())] == approx(1.0)
    assert values[("petatrain_tokens_per_second", ())] == approx(1024.0)
    assert values[("petatrain_data_wait_seconds_total", ())] == approx(2.7)  # recomputed steps waited too
    assert values[("petatrain_checkpoint_stall_seconds_total", ())] == approx(0.5)
    assert values[("petatrain_checkpoints_committed_total", ())] == 1
    assert values[("petatrain_loss", ())] == approx(0.5)
    assert values[("petatrain_eval_loss", ())] == approx(0.55)
    assert values[("petatrain_goodput", ())] == approx(g.goodput)
    with pytest.raises(OSError):
        urllib.request.urlopen(metrics.url, timeout=2)  # closed: the port no longer answers


def test_the_endpoint_knows_when_it_was_scraped_and_waits_for_a_scrape_after_a_moment(tmp_path):
    """What keeps an ended run's endpoint up for Prometheus' last scrape (the driver's linger)."""
    import threading
    import time

    with MetricsServer() as metrics:
        assert metrics.last_scrape is None  # never scraped: the driver does not wait at all
        _scrape(metrics.url)
        first = metrics.last_scrape
        assert first is not None
        ended = time.time()
        assert not metrics.wait_for_scrape(ended, 0.2)  # no scrape since: it times out
        later = threading.Timer(0.3, _scrape, [metrics.url])
        later.start()
        assert metrics.wait_for_scrape(ended, 10)
        later.join()
        assert metrics.last_scrape is not None and metrics.last_scrape > ended > first


def test_the_run_is_a_prometheus_file_sd_target():
    from petatrain.observe.metrics import file_sd_targets

    doc = json.loads(file_sd_targets("http://10.0.0.5:8078/metrics", {"run_id": "ab12", "run_dir": "s3://b/r"}))
    assert doc == [{"targets": ["10.0.0.5:8078"], "labels": {"run_id": "ab12", "run_dir": "s3://b/r"}}]


def test_pipeline_stages_have_metrics_of_their_own():
    stage = {"event": "pipeline_stage", "t": 1.0, "attempt": 0, "steps": 10, "stages": 2, "parts": [0], "units": []}
    stage |= {"schedule": "1F1B", "microbatches": 4, "chunks": 1}
    with MetricsServer() as metrics:
        metrics.observe({**stage, "rank": 0, "busy_s": 0.6, "wall_s": 1.0})
        metrics.observe({**stage, "rank": 1, "busy_s": 0.9, "wall_s": 1.0})
        metrics.observe({**stage, "rank": 0, "busy_s": 0.7, "wall_s": 1.0})
        values = _scrape(metrics.url)
    assert values[("petatrain_pipeline_stage_compute_seconds_total", (("rank", "0"),))] == approx(1.3)
    assert values[("petatrain_pipeline_stage_step_seconds_total", (("rank", "1"),))] == approx(1.0)
    assert values[("petatrain_pipeline_stage_idle_share", (("rank", "0"),))] == approx(0.3)
    assert values[("petatrain_pipeline_stage_idle_share", (("rank", "1"),))] == approx(0.1)


def test_steps_lost_counts_to_the_injected_step_when_other_ranks_events_were_lost(tmp_path):
    """Rank 0 sends step events once a second; a fault injected on rank 1 can end the attempt
    before rank 0's last events reach the ledger. The injected step still counts as reached."""
    s = Script(str(tmp_path))
    s.start(steps=30)
    s.now += 1.0
    s.steps(0, 1, 20, wait=0.0)
    s.checkpoint(0, 20, stall=0.1)
    s.steps(0, 21, 22, wait=0.0)  # steps 23-25 ran, but their events were still buffered
    s.emit("fault_injected", after=3.0, attempt=0, fault="kill", step=25, rank=1)
    s.emit("failure", after=0.5, attempt=0, cause="kill", detail="worker died", rank=1)
    s.restart(1, "kill", after=1.0, resume_after=1.0, next_step=21)
    s.steps(1, 21, 30, wait=0.0)
    s.emit("end", after=0.2, status="ok", step=30, detail="", final="f")
    s.close()

    (fault,) = account(read_events(str(tmp_path))).faults
    assert fault.step == 25 and fault.steps_lost == 5


def test_events_are_written_and_read_through_their_schema():
    from petatrain.observe import events

    line = events.record("restart", {"attempt": 2, "reason": "kill", "world_size": None})
    assert line["v"] == events.SCHEMA_VERSION and events.parse(line) == events.Restart(
        t=line["t"], attempt=2, reason="kill"
    )
    with pytest.raises(TypeError, match="typo"):
        events.record("restart", {"attempt": 2, "reason": "kill", "typo": 1})
    with pytest.raises(TypeError, match="no event kind"):
        events.record("restrat", {})
    with pytest.raises(ValueError, match="schema version"):
        events.parse({**line, "v": events.SCHEMA_VERSION + 1})


def test_an_event_that_does_not_fit_is_kept_and_flagged(tmp_path):
    from petatrain.observe.ledger import EventLog, read_events

    log = EventLog(str(tmp_path))
    log.emit("step", attempt=0, step=1, step_s=0.1, data_wait_s=0.0, loss=1.0, surprise=True)
    log.close()
    (line,) = read_events(str(tmp_path))
    assert line["step"] == 1 and "surprise" in line["schema_error"]


@pytest.mark.slow
def test_every_event_of_a_real_run_fits_its_schema(baseline):
    from helpers import kinds

    assert {"run_start", "attempt_start", "worker_start", "resume", "step", "checkpoint_commit", "end"} <= set(
        kinds(baseline)
    )
