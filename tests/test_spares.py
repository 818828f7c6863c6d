"""Spare worker processes (petatrain.runtime.startup.spares): started while a rank trains, taken by the next ranks."""

from __future__ import annotations

import os
import time
import types
import uuid

import pytest

from petatrain.runtime.startup import spares


def _wait_ready(rank, ray, count: int, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = ray.get(rank.spares_here.remote())
        if len(found) == count and all("ready" in s for s in found):
            return found
        assert time.monotonic() < deadline, f"spares not ready after {timeout_s} s: {found}"
        time.sleep(0.5)


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow  # end to end: starts Ray worker processes and a training attempt
def test_spares_start_warm_and_the_next_ranks_start_in_them(ray_local):
    ray = ray_local
    env = spares.worker_runtime_env(cpus_per_worker=1)
    env["env_vars"]["PETATRAIN_TEST_GROUP"] = uuid.uuid4().hex  # a runtime env no other test's actors share

    @ray.remote(num_cpus=0)
    class Rank:
        def start(self):
            self.spares = spares.Spares(local_rank=0, local_world=2, enabled=True)
            import torch

            assert torch.get_num_threads() == 1, "torch, imported before the actor, sized its pool as Ray would"
            return os.getpid(), spares.warmed()["started"]

        def train(self):
            self.spares.trained()  # as after a step: holds the training lock, tops up

        def top_up(self, count):
            return spares.top_up(count)

        def spares_here(self):
            return spares.spares_here()

    first = Rank.options(runtime_env=env).remote()
    first_pid, warmed = ray.get(first.start.remote(), timeout=120)
    assert warmed is not None, "the setup hook ran in the rank's own (cold) process too"
    assert ray.get(first.spares_here.remote()) == [], "a rank is not a spare"

    ray.get(first.train.remote())
    found = _wait_ready(first, ray, 2)
    assert all(s["idle"] == spares._can_leave_idle() for s in found), (
        "a spare imports at idle priority while a rank trains on its node (where it may return to normal)"
    )
    assert ray.get(first.top_up.remote(2)) == 0, "two spares live: none more"
    spare_pids = {s["pid"] for s in found}
    assert first_pid not in spare_pids
    quiet = spares._can_leave_idle()
    waiting = {os.SCHED_IDLE} if quiet else {os.SCHED_OTHER}
    for pid in spare_pids:  # an idle Ray worker still runs its loops: at idle priority while a rank trains
        _until(lambda pid=pid: _policies(pid) == waiting, f"spare {pid}: {_policies(pid)}, expected {waiting}")

    ray.kill(first)  # the attempt ends: nothing trains on the node, and the next ranks may start here
    ended = time.time()
    for pid in spare_pids:
        _until(lambda pid=pid: _policies(pid) == {os.SCHED_OTHER}, f"spare {pid} still at idle priority")
    nxt = [Rank.options(runtime_env=env).remote() for _ in range(2)]
    started = ray.get([r.start.remote() for r in nxt], timeout=120)
    assert {pid for pid, _ in started} == spare_pids, "the next ranks start in the spares"
    assert all(w < ended for _, w in started), "their imports were done before they were needed"
    assert ray.get(nxt[0].spares_here.remote()) == [], "a rank that starts in a spare takes it off the registry"
    for pid in spare_pids:
        assert _policies(pid) == {os.SCHED_OTHER}, "a rank runs at normal priority"

    # Nothing trains on the node now (the ranks that hold the lock have ended): a spare imports
    # at normal priority, as one started during a restart must.
    assert ray.get(nxt[0].top_up.remote(1)) == 1
    (late,) = _wait_ready(nxt[0], ray, 1)
    assert late["idle"] is False
    for rank in nxt:
        ray.kill(rank)


def test_no_spares_for_a_group_without_the_warm_up_hook(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    def ask():
        return spares.top_up(2)

    assert ray.get(ask.options(runtime_env={"env_vars": {"PETATRAIN_TEST_GROUP": "cold"}}).remote()) == 0


@pytest.mark.parametrize(
    ("overrides", "hook", "tops_up"),
    [
        ([], True, True),
        # no restarts: no spares of its own, but its ranks start in those an earlier run of the job left
        (["faults.max_restarts=0"], True, False),
        (["faults.spares=false"], False, False),
    ],
)
def test_a_run_without_restarts_still_starts_in_spares_it_does_not_make(ray_local, overrides, hook, tops_up):
    from petatrain import config
    from petatrain.runtime.trainer import make_trainer

    cfg = config.load(None, overrides)
    trainer = make_trainer(cfg, types.SimpleNamespace(hub=None), 2, "r", 0, local=True)
    env = trainer.run_config.worker_runtime_env
    assert (spares.HOOK_ENV in (env or {}).get("env_vars", {})) == hook, env
    assert spares.wanted(cfg) == tops_up
