"""Realized capacity next to the plan (capacity.py): what each engine's worker is asked to
realize, and a difference of more than one page per rank (or any in requests) reported naming
the worker, the figure and both values."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from repo_paths import SAMPLES
from support.pods import running_pod
from support.sglang_stand_in import flag, realized

from dsv4_common.api import RankCapacity
from dsv4_common.api.deployment import MemoryPlan, plan_memory
from dsv4_common.api.spec import DeploymentSpec, parse_meta, parse_spec
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_operator import labels as L
from dsv4_operator.capacity import CAPACITY_KEYS, Seen, mismatches, pinned, seen_capacity
from dsv4_operator.flavors.sglang.command import server_args
from dsv4_operator.flavors.sglang.info import ServerInfo
from dsv4_operator.observe import Observed, PodState


def _load(sample: str, **model: str) -> tuple[DeploymentSpec, MemoryPlan, dict[str, Any]]:
    body = yaml.safe_load((SAMPLES / sample).read_text())
    body["metadata"]["namespace"] = "ns"
    if model:
        body["spec"]["model"] = model
    spec = parse_spec(body)
    return spec, plan_memory(spec), body


# Our engine, PP > 1 in both roles (its configPath stands for the preset's config).
PRO_PP = _load("pro-pd-pp.yaml", preset="deepseek-v4-pro")
SGL = _load("sglang-flash-pd.yaml")  # SGLang, prefill PP 2


def _seen_as_planned(spec: DeploymentSpec, plan: MemoryPlan, role: L.WorkerRole) -> list[Seen]:
    return [
        Seen(
            worker=f"w-{role}-{r.pp_rank}",
            role=role,
            pp_ranks=(r.pp_rank,),
            capacity=r.capacity,
        )
        for r in plan.role(role).ranks
    ]


def _seen(worker: str, role: L.WorkerRole, pp_ranks: tuple[int, ...], **figures: int) -> Seen:
    """A worker's report of the figures given; the others are unreported."""
    capacity = RankCapacity(**{name: figures.get(name, 0) for name in CAPACITY_KEYS})
    return Seen(worker, role, pp_ranks, capacity, frozenset(CAPACITY_KEYS.keys() - figures))


def test_our_workers_are_asked_for_their_own_ranks_plan() -> None:
    spec, plan, _ = PRO_PP
    for role in L.WORKER_ROLES:
        ranks = plan.role(role).ranks
        assert len(ranks) > 1
        for r in ranks:
            want = pinned(spec, plan, role, r.pp_rank)
            c = want.capacity
            assert (c.full_tokens, c.swa_tokens, c.max_running_requests) == (
                r.capacity.full_tokens,
                r.capacity.swa_tokens,
                r.capacity.max_running_requests,
            )
        seen = _seen_as_planned(spec, plan, role)
        assert mismatches(spec, plan, seen) == []


def test_sglang_is_asked_for_what_its_command_line_says_on_every_rank() -> None:
    """The figures come from the rendered argv (the pools as the SGLang stand-in sizes them
    from it), the same for every PP rank."""
    spec, plan, body = SGL
    for role in L.WORKER_ROLES:
        argv = server_args(spec, parse_meta(body), plan, role, 0)
        info = realized(argv)
        full, page = info["max_total_num_tokens"], int(flag(argv, "--page-size"))
        swa = info["internal_states"][0]["memory_usage"]["token_capacity_swa"]
        for r in plan.role(role).ranks:
            want = pinned(spec, plan, role, r.pp_rank)
            c = want.capacity
            assert (c.full_tokens, c.swa_tokens, want.page_size) == (full, swa, page)
            assert c.max_running_requests == int(flag(argv, "--max-running-requests"))


@given(delta_pages=st.floats(-3.0, 3.0, allow_nan=False), rank=st.integers(0, 1))
def test_a_difference_of_more_than_a_page_is_reported_and_one_within_is_not(
    delta_pages: float, rank: int
) -> None:
    spec, plan, _ = PRO_PP
    seen = _seen_as_planned(spec, plan, "prefill")
    page = plan.role("prefill").inputs.resolved_page_size
    delta = round(delta_pages * page)
    realized = seen[rank].capacity
    realized = replace(realized, full_tokens=realized.full_tokens + delta)
    seen[rank] = replace(seen[rank], capacity=realized)
    lines = mismatches(spec, plan, seen)
    if abs(delta) <= page:
        assert lines == []
    else:
        planned = plan.role("prefill").ranks[rank].capacity.full_tokens
        assert lines == [
            f"w-prefill-{rank} (prefill, PP rank {rank}): fullTokens {planned + delta} realized, "
            f"{planned} planned ({delta / page:+.1f} pages)"
        ]


def test_requests_must_match_exactly_and_unreported_figures_are_not_compared() -> None:
    spec, plan, _ = SGL
    want = pinned(spec, plan, "decode", 0).capacity
    figures = {"full_tokens": want.full_tokens, "max_context_tokens": 131072}
    base = _seen("flash-sgl-decode-1-0", "decode", (0,), **figures)
    assert mismatches(spec, plan, [base]) == []  # swa and requests unknown
    fewer = _seen(
        "flash-sgl-decode-1-0",
        "decode",
        (0,),
        **figures,
        max_running_requests=want.max_running_requests - 1,
    )
    (line,) = mismatches(spec, plan, [fewer])
    assert line == (
        f"flash-sgl-decode-1-0 (decode, PP rank 0): maxRunningRequests "
        f"{want.max_running_requests - 1} realized, {want.max_running_requests} planned"
    )


def test_an_sglang_group_reports_once_for_all_its_ranks() -> None:
    spec, plan, _ = SGL
    want = pinned(spec, plan, "prefill", 0)
    short = _seen(
        "flash-sgl-prefill-0-0",
        "prefill",
        (0, 1),
        full_tokens=want.capacity.full_tokens - 4 * want.page_size,
        max_context_tokens=131072,
        swa_tokens=want.capacity.swa_tokens,
    )
    assert mismatches(spec, plan, [short]) == [
        f"flash-sgl-prefill-0-0 (prefill, PP ranks 0-1): fullTokens "
        f"{short.capacity.full_tokens} realized, {want.capacity.full_tokens} planned (-4.0 pages)"
    ]


def test_a_rank_the_plan_does_not_have_is_a_difference() -> None:
    spec, plan, _ = SGL
    seen = _seen("x-0", "decode", (0, 1), full_tokens=0, max_context_tokens=0)
    (line,) = mismatches(spec, plan, [seen])
    assert "PP rank 1 is not in the plan (1 ranks)" in line and "fullTokens 0 realized" in line


def _pod(name: str, role: str, rank: int) -> PodState:
    return running_pod(name, role=role, pp_rank=rank, template_hash="h", ip="127.0.0.2")


def test_seen_capacity_takes_both_engines_reports_and_skips_stale_pods() -> None:
    spec, _, _ = SGL
    info = ServerInfo(full_tokens=4096, context_tokens=8192, swa_tokens=512)
    report = WorkerStatus(
        role="decode",
        pp_rank=0,
        capacity=RankCapacity(
            full_tokens=100, swa_tokens=10, max_running_requests=3, max_context_tokens=50
        ),
    )
    observed = Observed(
        pods=(_pod("p-0-0", "prefill", 0), _pod("d-0-0", "decode", 0), _pod("d-1-0", "decode", 0)),
        reports={"r-0": report, "old-0": report},
        server_info={"p-0-0": info, "d-0-0": info, "d-1-0": info, "gone-0": info},
    )
    seen = seen_capacity(spec, observed, stale={"old-0", "d-1-0"})
    assert [(s.worker, s.role, s.pp_ranks) for s in seen] == [
        ("d-0-0", "decode", (0,)),
        ("p-0-0", "prefill", (0, 1)),  # prefill PP 2: rank 0 speaks for both
        ("r-0", "decode", (0,)),
    ]
    assert seen[1].figure("max_context_tokens") == 4096 and seen[1].figure("swa_tokens") == 512


@pytest.mark.parametrize("role", L.WORKER_ROLES)
def test_sglang_figures_are_a_groups_least(role: L.WorkerRole) -> None:
    spec, plan, _ = SGL
    ranks = plan.role(role).ranks
    assert pinned(spec, plan, role, 0).capacity.full_tokens == min(
        r.capacity.full_tokens for r in ranks
    )


def test_the_status_keys_name_every_rank_capacity_figure_in_order() -> None:
    assert tuple(CAPACITY_KEYS) == tuple(f.name for f in fields(RankCapacity))
