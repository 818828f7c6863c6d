"""What this host, or the container petatrain runs in, has left: memory."""

from __future__ import annotations

import os

_CGROUP_ROOT = "/sys/fs/cgroup"
_MEMBERSHIP = "/proc/self/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")


def memory_left() -> int | None:
    """Bytes this process may still take before its memory cgroup's limit (a pod's, a systemd
    slice's, any of its ancestors') or the host's available memory (MemAvailable) runs out, whichever
    is less; None when neither can be read (not Linux)."""
    found = []
    left = cgroup_left()
    if left is not None:
        found.append(left)
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    return min(found) if found else None


def cgroup_left(root: str = _CGROUP_ROOT, membership: str = _MEMBERSHIP) -> int | None:
    """The least room left under the memory limits of this process's cgroup and of its ancestors,
    found from `/proc/self/cgroup` (v1's memory controller where it has one, else v2's unified
    hierarchy); None where no limit is set or none can be read.

    The process's own cgroup, not the mount's root: on a host without cgroup namespaces (a systemd
    service, a container sharing the host's) the root is the whole machine's. A cgroup path the mount
    does not show (a container's view of its own cgroup as the root) is walked up to what it shows."""
    try:
        with open(membership) as handle:
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    unified = memory = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            unified = path
        elif "memory" in controllers.split(","):
            memory = path
    if memory is not None:
        return _least_left(os.path.join(root, "memory"), memory, *_V1)
    if unified is not None:
        return _least_left(root, unified, "memory.max", "memory.current")
    # No membership to read: the mount's own files, v2 then v1.
    left = _left_in(root, "memory.max", "memory.current")
    return left if left is not None else _left_in(os.path.join(root, "memory"), *_V1)


def _least_left(base: str, path: str, limit_name: str, usage_name: str) -> int | None:
    lefts = []
    folder = os.path.normpath(os.path.join(base, path.lstrip("/")))
    base = os.path.normpath(base)
    while True:
        left = _left_in(folder, limit_name, usage_name)
        if left is not None:
            lefts.append(left)
        if folder == base or not folder.startswith(base + os.sep):
            break
        folder = os.path.dirname(folder)
    return min(lefts) if lefts else None


def _left_in(folder: str, limit_name: str, usage_name: str) -> int | None:
    """limit - usage in `folder`; None where it cannot be read or sets no limit ("max", v1's 2^63)."""
    try:
        with open(os.path.join(folder, limit_name)) as limit_handle, open(os.path.join(folder, usage_name)) as usage:
            limit, used = limit_handle.read().strip(), usage.read().strip()
    except OSError:
        return None
    if limit.isdigit() and int(limit) < _UNLIMITED and used.isdigit():
        return max(int(limit) - int(used), 0)
    return None
