"""The CPUs this process may use: the smallest of its affinity mask and the CPU quota of its
cgroup and every cgroup above it (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`).
The worker sizes torch's threads from it, the router its processes.

Pure parsing (`quota_v2`, `quota_v1`, `cgroup_cpus`) apart from the reads (`read_cpu_limit`,
`affinity_cpus`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def quota_v2(cpu_max: str) -> float | None:
    """CPUs of a cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD"); None: unlimited."""
    fields = cpu_max.split()
    if not fields or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def quota_v1(quota_us: str, period_us: str) -> float | None:
    """CPUs of a cgroup v1 CFS quota; None: unlimited (-1)."""
    quota, period = int(quota_us), int(period_us)
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpus(quotas: Sequence[float | None], affinity: int) -> float:
    """The CPUs a process may use: its affinity, capped by every quota on its cgroup path."""
    limits = [q for q in quotas if q is not None]
    return min([float(affinity), *limits])


def _v2_dirs(root: Path, proc_cgroup: str) -> list[Path]:
    """The process's cgroup v2 directory and its ancestors up to `root`."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
            here = root / rel if rel else root
            return [here, *[p for p in here.parents if p.is_relative_to(root)]]
    return []


def read_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> list[float | None]:
    """Every CPU quota on this process's cgroup path (v2, else v1); empty when none is readable
    (no cgroup filesystem: not a container)."""
    quotas: list[float | None] = []
    try:
        for d in _v2_dirs(root, _read(proc_cgroup)):
            if (d / "cpu.max").is_file():
                quotas.append(quota_v2(_read(d / "cpu.max")))
    except (OSError, ValueError):
        pass
    if quotas:
        return quotas
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quotas.append(quota_v1(_read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")))
            break
        except (OSError, ValueError):
            continue
    return quotas


def _read(path: Path) -> str:
    return path.read_text().strip()


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_cpus() -> float:
    return cgroup_cpus(read_cpu_limit(), affinity_cpus())
