"""How much memory a worker has left: its own cgroup's limit and its ancestors', not the mount's root."""

from __future__ import annotations

from pathlib import Path

from petatrain.host import cgroup_left, memory_left


def _cgroup(folder: Path, limit: str, used: int, *, v1: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
    (folder / names[0]).write_text(f"{limit}\n")
    (folder / names[1]).write_text(f"{used}\n")


def test_the_processs_own_cgroup_and_the_tightest_ancestor_set_the_limit(tmp_path):
    """A systemd service (v2, no cgroup namespace): the root has no limit, the slice 4 GiB, the
    service 2 GiB; the slice, with its other services, has less left than the service."""
    root = tmp_path / "cgroup"
    _cgroup(root, "max", 50 << 30)
    _cgroup(root / "work.slice", str(4 << 30), 3 << 30)
    _cgroup(root / "work.slice" / "ingest.service", str(2 << 30), 1 << 29)
    membership = tmp_path / "self-cgroup"
    membership.write_text("0::/work.slice/ingest.service\n")
    assert cgroup_left(str(root), str(membership)) == 1 << 30  # the slice's 4 - 3 GiB, not the service's 1.5
    # A pod's view (cgroup namespace: "/" is its own cgroup, its limit in the root's files).
    membership.write_text("0::/\n")
    _cgroup(root, str(1 << 30), 1 << 28)
    assert cgroup_left(str(root), str(membership)) == 3 << 28


def test_cgroup_v1_memory_controller_and_a_path_the_mount_does_not_show(tmp_path):
    """v1 (this machine's kind): the memory controller's line names the cgroup. A container that sees
    its own cgroup as the mount's root while /proc/self/cgroup names the host's path: walked up."""
    root = tmp_path / "cgroup"
    _cgroup(root / "memory", str(2**63 - 4096), 5 << 30, v1=True)  # "no limit"
    membership = tmp_path / "self-cgroup"
    membership.write_text("4:memory:/process_api/job7\n0::/\n")
    assert cgroup_left(str(root), str(membership)) is None  # no limit anywhere up the path
    _cgroup(root / "memory" / "process_api" / "job7", str(3 << 30), 1 << 30, v1=True)
    assert cgroup_left(str(root), str(membership)) == 2 << 30
    membership.write_text("4:memory:/docker/abc\n")  # not under this mount: its root is the container's
    _cgroup(root / "memory", str(6 << 30), 5 << 30, v1=True)
    assert cgroup_left(str(root), str(membership)) == 1 << 30


def test_memory_left_on_this_machine_is_a_count_of_bytes():
    left = memory_left()
    assert left is None or left >= 0
