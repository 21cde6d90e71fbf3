"""Torch's intra-op and inter-op thread counts for this worker, decided once at startup.

Pure decisions (`cgroup_cpus`, `decide_threads`) apart from the reads (`read_cpu_limit`,
`affinity_cpus`) and the one side effect (`apply_threads`). Precedence: the `--torch-threads`
flag, then the rank config's `torch_threads` (the operator's, from the pod's CPU request), then
the CPUs this process may use (`dsv4_common.plan.threads.torch_threads`): the smallest of its
affinity mask and the CPU quota of its cgroup and every cgroup above it (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`).

NOTE: torch sets the inter-op count only before its first parallel work, and only once per
process; `apply_threads` must run before the model loads. Later calls keep what is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from dsv4_common.plan.threads import INTEROP_THREADS, torch_threads

log = logging.getLogger(__name__)

ThreadSource = Literal["flag", "rank_config", "auto"]
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    intra_op: int
    inter_op: int
    source: ThreadSource
    cpus: float  # the CPUs the process may use (what "auto" decided from)


def decide_threads(flag: int | None, configured: int | None, cpus: float) -> ThreadPlan:
    """The flag wins, then the rank config, then the rule over `cpus`."""
    if flag is not None:
        return _given(flag, "flag", cpus)
    if configured is not None:
        return _given(configured, "rank_config", cpus)
    return ThreadPlan(torch_threads(cpus), INTEROP_THREADS, "auto", cpus)


def _given(threads: int, source: ThreadSource, cpus: float) -> ThreadPlan:
    if threads < 1:
        raise ValueError(f"torch threads from the {source}: {threads} must be >= 1")
    return ThreadPlan(threads, INTEROP_THREADS, source, cpus)


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


def apply_threads(plan: ThreadPlan) -> ThreadPlan:
    """Set torch's thread counts; returns what torch runs with (an inter-op count set earlier
    in this process stays, with a warning)."""
    torch.set_num_threads(plan.intra_op)
    try:
        torch.set_num_interop_threads(plan.inter_op)
    except RuntimeError as exc:
        log.warning("torch inter-op threads stay %d: %s", torch.get_num_interop_threads(), exc)
    applied = ThreadPlan(
        torch.get_num_threads(), torch.get_num_interop_threads(), plan.source, plan.cpus
    )
    log.info(
        "torch threads: %d intra-op, %d inter-op (%s; %.2f CPUs available)",
        applied.intra_op,
        applied.inter_op,
        applied.source,
        applied.cpus,
    )
    return applied


def configure_threads(flag: int | None, configured: int | None) -> ThreadPlan:
    """Decide and apply, once at startup (before the model loads)."""
    cpus = available_cpus()
    return apply_threads(decide_threads(flag, configured, cpus))
