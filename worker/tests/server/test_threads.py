"""Torch thread counts (`dsv4_worker.threads`, rule in `dsv4_common.plan.threads`): the rule
over the CPUs a process may use, the precedence flag > rank config > auto, the cgroup quota
readers (v2 up the hierarchy, v1) and what torch runs with after `apply_threads`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.plan.threads import INTEROP_THREADS, RESERVED_CPUS, torch_threads
from dsv4_worker.threads import (
    ThreadPlan,
    apply_threads,
    cgroup_cpus,
    decide_threads,
    quota_v1,
    quota_v2,
    read_cpu_limit,
)

CPUS = st.floats(min_value=0.01, max_value=512, allow_nan=False)
COUNT = st.one_of(st.none(), st.integers(1, 256))


@given(CPUS)
def test_the_rule_leaves_a_core_to_the_worker_and_never_goes_below_one(cpus: float) -> None:
    n = torch_threads(cpus)
    assert n >= 1
    # whole cores only (a quota's fraction is not one), one kept for the worker's own threads
    assert n == max(1, math.floor(cpus + 1e-9) - RESERVED_CPUS)
    assert n <= max(1, math.floor(cpus + 1e-9))  # never more threads than cores
    assert torch_threads(cpus + 1) >= n  # monotone


def test_the_measured_case_two_cores_one_thread() -> None:
    # #26 and #38 (docs/real-model.md "Torch threads"): served over HTTP on a 2-core VM, one
    # torch thread gave 1.4-2x the tokens/s of two, for tiny and for medium
    assert torch_threads(2) == 1
    assert [torch_threads(c) for c in (0.5, 1, 3, 16)] == [1, 1, 2, 15]
    with pytest.raises(ValueError):
        torch_threads(0)


def test_the_worker_makes_torch_s_openmp_workers_spin_briefly_unless_told_otherwise() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import dsv4_worker, os; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    )
    chosen = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in chosen}

    def run(**extra: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env | extra, capture_output=True, text=True
        )
        return out.stdout.strip()

    assert run() == "None 10000"  # no policy: libgomp spins that long, then sleeps
    assert run(OMP_WAIT_POLICY="PASSIVE") == "PASSIVE None"  # the environment's choice stands
    assert run(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
    assert run(GOMP_SPINCOUNT="500") == "None 500"


@given(COUNT, COUNT, CPUS)
def test_the_flag_wins_then_the_rank_config_then_the_cpus(
    flag: int | None, configured: int | None, cpus: float
) -> None:
    plan = decide_threads(flag, configured, cpus)
    assert plan.inter_op == INTEROP_THREADS and plan.cpus == cpus
    if flag is not None:
        assert (plan.intra_op, plan.source) == (flag, "flag")
    elif configured is not None:
        assert (plan.intra_op, plan.source) == (configured, "rank_config")
    else:
        assert (plan.intra_op, plan.source) == (torch_threads(cpus), "auto")


def test_a_zero_count_is_refused() -> None:
    with pytest.raises(ValueError, match="rank_config"):
        decide_threads(None, 0, 4)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000", None), ("200000 100000", 2.0), ("50000 100000", 0.5), ("150000", 1.5)],
)
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert quota_v2(text) == cpus


def test_cgroup_v1_quota() -> None:
    assert quota_v1("-1", "100000") is None
    assert quota_v1("300000", "100000") == 3.0


@given(st.lists(st.one_of(st.none(), CPUS), max_size=4), st.integers(1, 256))
def test_the_cpus_are_the_affinity_capped_by_every_quota(
    quotas: list[float | None], affinity: int
) -> None:
    cpus = cgroup_cpus(quotas, affinity)
    assert cpus <= affinity
    assert all(cpus <= q for q in quotas if q is not None)
    assert cpus in {float(affinity), *(q for q in quotas if q is not None)}


def test_v2_quotas_are_read_up_the_hierarchy(tmp_path: Path) -> None:
    leaf = tmp_path / "kubepods" / "pod1" / "worker"
    leaf.mkdir(parents=True)
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    (leaf / "cpu.max").write_text("400000 100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1/worker\n")
    quotas = read_cpu_limit(tmp_path, proc)
    assert sorted(q for q in quotas if q is not None) == [1.5, 4.0]
    assert cgroup_cpus(quotas, 8) == 1.5


def test_v1_and_no_cgroup_at_all(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:cpu,cpuacct:/\n")
    assert read_cpu_limit(tmp_path, proc) == []  # nothing readable: the affinity decides
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert read_cpu_limit(tmp_path, proc) == [2.5]


def test_apply_sets_torch_and_reports_what_it_runs_with() -> None:
    before = torch.get_num_threads()
    try:
        applied = apply_threads(ThreadPlan(1, INTEROP_THREADS, "flag", 2.0))
        assert torch.get_num_threads() == applied.intra_op == 1
        assert applied.inter_op == torch.get_num_interop_threads()  # set once per process
        assert (applied.source, applied.cpus) == ("flag", 2.0)
    finally:
        torch.set_num_threads(before)
