"""Torch's intra-op and inter-op thread counts for this worker, decided once at startup.

Pure decisions (`decide_threads`) apart from the reads (`dsv4_common.core.cpus`, shared with
the router) and the one side effect (`apply_threads`). Precedence: the `--torch-threads`
flag, then the rank config's `torch_threads` (the operator's, from the pod's CPU request), then
the CPUs this process may use (`dsv4_common.plan.threads.torch_threads`): the smallest of its
affinity mask and the CPU quota of its cgroup and every cgroup above it (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`).

NOTE: torch sets the inter-op count only before its first parallel work, and only once per
process; `apply_threads` must run before the model loads. Later calls keep what is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_common.core.cpus import (  # noqa: F401 (re-exported: the worker's thread tests)
    available_cpus,
    cgroup_cpus,
    quota_v1,
    quota_v2,
    read_cpu_limit,
)
from dsv4_common.plan.threads import INTEROP_THREADS, torch_threads

log = logging.getLogger(__name__)

ThreadSource = Literal["flag", "rank_config", "auto"]


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
