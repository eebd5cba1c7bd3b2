"""`auto` sizing inside a container: the cgroup's CPU quota and memory limit, not the host's."""

from __future__ import annotations

import os

import pytest

from gpt2serve.launch.resources import available_cpus, available_memory_bytes, cgroup_cpus, cgroup_memory_bytes

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
AFFINITY = len(os.sched_getaffinity(0))


def write(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


@pytest.mark.parametrize("files, cpus, memory", [
    ({"cpu.max": "max 100000", "memory.max": "max"}, None, None),  # v2, no limits
    ({"cpu.max": "150000 100000", "memory.max": str(2**30)}, 1.5, 2**30),  # v2: 1.5 CPUs, 1 GiB
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
      "memory/memory.limit_in_bytes": str(2**63 - 4096)}, None, None),  # v1, no limits
    ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000",
      "memory/memory.limit_in_bytes": str(3 * 2**30)}, 0.5, 3 * 2**30),  # v1: half a CPU, 3 GiB
    ({}, None, None),  # no cgroup files at all
])
def test_cgroup_limits_are_read_in_both_versions(tmp_path, files, cpus, memory):
    root = write(tmp_path, files)
    assert cgroup_cpus(root) == cpus and cgroup_memory_bytes(root) == memory
    assert available_memory_bytes(root) == min(PHYSICAL, memory or PHYSICAL)
    expected_cpus = AFFINITY if cpus is None else max(1, min(AFFINITY, -(-cpus // 1)))
    assert available_cpus(root) == expected_cpus


def test_a_limit_above_the_machine_changes_nothing(tmp_path):
    root = write(tmp_path, {"cpu.max": f"{(AFFINITY + 8) * 100000} 100000", "memory.max": str(PHYSICAL * 4)})
    assert available_cpus(root) == AFFINITY and available_memory_bytes(root) == PHYSICAL
