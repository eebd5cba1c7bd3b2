"""What this process may use: CPUs and memory as its container's cgroup limits them.

`os.cpu_count()` and the physical pages describe the host: inside a container limited to 2 CPUs
and 4 GiB on a 64-core, 512 GiB host they say 64 and 512 GiB, so `auto` sizes (front ends,
torch's threads, the KV cache) would be set for a machine the server does not have. These read
the cgroup's limits (v2 `cpu.max` / `memory.max`, or v1's CFS quota and memory limit) and take
the smaller. Outside a container there is no limit, and the host's numbers stand.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")  # inside a container, its own cgroup (a cgroup namespace's root)
UNLIMITED_V1 = 2**60  # cgroup v1 writes "no limit" as a huge number near 2**63


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpus(cgroup: Path = CGROUP) -> float | None:
    """CPUs the cgroup's quota allows (e.g. 2.5), or None without a quota."""
    v2 = _read(cgroup / "cpu.max")  # "max 100000" or "250000 100000"
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    quota, period = _read(cgroup / "cpu" / "cpu.cfs_quota_us"), _read(cgroup / "cpu" / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def cgroup_memory_bytes(cgroup: Path = CGROUP) -> int | None:
    """The cgroup's memory limit, or None without one."""
    v2 = _read(cgroup / "memory.max")
    if v2 is not None:
        return None if v2 == "max" else int(v2)
    v1 = _read(cgroup / "memory" / "memory.limit_in_bytes")
    return None if v1 is None or int(v1) >= UNLIMITED_V1 else int(v1)


def available_cpus(cgroup: Path = CGROUP) -> int:
    """Whole CPUs this process may keep busy: its affinity, capped by the cgroup quota (rounded
    up: a 2.5-CPU quota keeps 3 threads about 83% busy, better than 2 fully)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpus(cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def available_memory_bytes(cgroup: Path = CGROUP) -> int:
    """Physical memory, capped by the cgroup's limit."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_bytes(cgroup)
    return min(physical, limit) if limit else physical
