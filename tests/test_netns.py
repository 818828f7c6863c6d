"""Fault 4 harness: a two-node Ray cluster across network namespaces loses its node in seconds."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from petatrain.chaos.netns import PartitionRefusedError, TwoNodeCluster, cut_own_link

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

DRIVER = Path(__file__).with_name("netns_driver.py")
DETECT_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def netns_ok():
    """Skip unless this process may make network namespaces (a failure in CI)."""
    from helpers import need_network_namespaces

    need_network_namespaces()


def read_event(driver: subprocess.Popen, phase: str, timeout_s: float = 90) -> dict:
    """The driver's next JSON line, which must be `phase`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([driver.stdout], [], [], 1.0)
        if not ready:
            if driver.poll() is not None:
                break
            continue
        line = driver.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            event = json.loads(line)
            assert event["phase"] == phase, event
            return event
    driver.kill()
    pytest.fail(
        f"driver gave no '{phase}' within {timeout_s} s (exit {driver.poll()}):\n{driver.stderr.read()[-4000:]}"
    )


def tell(driver: subprocess.Popen) -> None:
    driver.stdin.write("go\n")
    driver.stdin.flush()


def test_cut_link_loses_node_within_seconds_and_cleans_up(netns_ok):
    t0 = time.monotonic()
    cluster = TwoNodeCluster()
    with cluster:
        print(f"\ncluster started in {cluster.start_s:.1f} s")
        driver = cluster.popen(
            [sys.executable, str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready = read_event(driver, "ready")
            assert ready["node"] != ready["head"], "the probe actor must run on the worker node"
            cut_at = time.time()
            cluster.cut()
            tell(driver)
            lost = read_event(driver, "lost")
            assert lost["dead_at"] is not None, f"head never marked the node dead: {lost}"
            assert lost["failed_at"] is not None, f"actor call on the lost node never failed: {lost}"
            dead_s, failed_s = lost["dead_at"] - cut_at, lost["failed_at"] - cut_at
            print(f"cut(): node dead after {dead_s:.1f} s, actor call failed after {failed_s:.1f} s: {lost['error']}")
            assert dead_s < DETECT_WITHIN_S and failed_s < DETECT_WITHIN_S
            assert "ActorDiedError" in lost["error"] or "ActorUnavailableError" in lost["error"], lost["error"]
            assert driver.wait(timeout=30) == 0, driver.stderr.read()[-4000:]
            # A fresh node joining after a cut (restart_worker) and a partition a worker injects
            # itself (cut_own_link) are what the two-node training tests do:
            # helpers.partitioned_and_grown_back.
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        assert all(cluster.pids().values()), "both namespaces should have Ray processes before stop"

    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert cluster.head_ns not in names and cluster.worker_ns not in names
    assert not any(cluster.pids().values())
    assert not cluster.temp_root.exists()
    print(f"whole test {time.monotonic() - t0:.1f} s")


def test_cut_own_link_refuses_outside_harness_namespaces(netns_ok):
    with pytest.raises(PartitionRefusedError, match="refusing to cut the network"):
        cut_own_link()

    # A namespace this harness did not make (a container's, say) is refused too, and left up.
    foreign = f"ptx-foreign-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        subprocess.run(["ip", "-n", foreign, "link", "add", "pt-a", "type", "veth", "peer", "name", "pt-b"], check=True)
        subprocess.run(["ip", "-n", foreign, "link", "set", "dev", "pt-a", "up"], check=True)
        code = "from petatrain.chaos.netns import cut_own_link\ncut_own_link()"
        done = subprocess.run(
            ["ip", "netns", "exec", foreign, sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "was not made by TwoNodeCluster" in done.stderr, done.stderr
        link = subprocess.run(["ip", "-n", foreign, "-o", "link", "show", "pt-a"], capture_output=True, text=True)
        assert "UP" in link.stdout.split("<")[1].split(">")[0].split(","), link.stdout
    finally:
        subprocess.run(["ip", "netns", "delete", foreign])
