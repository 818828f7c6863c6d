"""What this host, or the container petatrain runs in, has left: memory."""

from __future__ import annotations

_CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def memory_left() -> int | None:
    """Bytes this process may still take before its container's memory limit (a pod's cgroup) or the
    host's available memory (MemAvailable) runs out, whichever is less; None when neither can be read
    (not Linux)."""
    found = []
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as limit_handle, open(usage_file) as usage_handle:
                limit, usage = limit_handle.read().strip(), usage_handle.read().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60 and usage.isdigit():  # not "max", nor v1's "no limit"
            found.append(max(int(limit) - int(usage), 0))
        break
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    return min(found) if found else None
