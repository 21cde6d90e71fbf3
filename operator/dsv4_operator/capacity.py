"""Realized capacity next to the plan, for either engine. Pure.

- engine dsv4: each worker reports its own rank's figures on `/status` (one `Seen` per pod).
- engine sglang: PP rank 0 of a group answers `/server_info` for the whole group (SGLang sizes
  every rank's pool to the least over the ranks), so one `Seen` covers every rank.

What a worker was asked to realize (`pinned`): for our worker, its rank's plan; for SGLang,
the figures the operator put on its command line (`sglang_command.group_figures`), the same on
every rank. A realized figure that differs from it by more than one page (`mismatches`) means
the plan did not predict the engine: a GPU with less free memory than `spec.gpu` says, memory
taken before the pools were sized, or an engine version that prices KV differently.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.spec import DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.observe import Observed
from dsv4_operator.sglang_command import group_figures, sglang_swa_tokens


@dataclass(frozen=True, slots=True)
class Seen:
    """One worker's realized capacity, for the PP ranks it speaks for."""

    worker: str  # the pod that reported it
    role: L.WorkerRole
    pp_ranks: tuple[int, ...]
    full_tokens: int
    max_context_tokens: int
    swa_tokens: int | None = None  # None: not reported
    max_running_requests: int | None = None  # None: not reported

    def ranks_text(self) -> str:
        first, last = self.pp_ranks[0], self.pp_ranks[-1]
        return f"PP rank {first}" if first == last else f"PP ranks {first}-{last}"


@dataclass(frozen=True, slots=True)
class Pinned:
    """What a rank was asked to realize."""

    full_tokens: int
    swa_tokens: int
    max_running_requests: int
    page_size: int


def seen_capacity(
    spec: DeploymentSpec, observed: Observed, stale: Collection[str] = ()
) -> tuple[Seen, ...]:
    """Every worker's report, sorted by pod name; pods in `stale` (an outdated template, so an
    older plan) are left out."""
    out: list[Seen] = []
    for name, r in observed.reports.items():
        if name in stale or r.role not in L.WORKER_ROLES:
            continue
        out.append(
            Seen(
                worker=name,
                role=r.role,
                pp_ranks=(r.pp_rank,),
                full_tokens=r.full_tokens,
                max_context_tokens=r.max_context_tokens,
                swa_tokens=r.swa_tokens,
                max_running_requests=r.max_running_requests,
            )
        )
    pods = {p.name: p for p in observed.pods}
    for name, info in observed.server_info.items():
        pod = pods.get(name)
        if name in stale or pod is None or pod.role not in L.WORKER_ROLES:
            continue
        role: L.WorkerRole = pod.role
        out.append(
            Seen(
                worker=name,
                role=role,
                pp_ranks=tuple(range(spec.role(role).pipeline_parallel)),
                full_tokens=info.full_tokens,
                max_context_tokens=info.max_context_tokens,
                swa_tokens=info.swa_tokens,
                max_running_requests=info.max_running_requests,
            )
        )
    return tuple(sorted(out, key=lambda s: s.worker))


def pinned(spec: DeploymentSpec, plan: MemoryPlan, role: L.WorkerRole, pp_rank: int) -> Pinned:
    role_plan = plan.role(role)
    page = role_plan.inputs.resolved_page_size
    if spec.engine.sglang:
        g = group_figures(role_plan)
        return Pinned(
            full_tokens=g.full_tokens,
            swa_tokens=sglang_swa_tokens(g.full_tokens, g.swa_ratio, page),
            max_running_requests=g.max_running_requests,
            page_size=page,
        )
    rank = role_plan.ranks[pp_rank]
    return Pinned(
        full_tokens=rank.full_tokens,
        swa_tokens=rank.swa_tokens,
        max_running_requests=rank.max_running_requests,
        page_size=page,
    )


def _tokens(name: str, seen: int, want: int, page_size: int) -> str | None:
    if abs(seen - want) <= page_size:
        return None
    pages = (seen - want) / page_size
    return f"{name} {seen} realized, {want} planned ({pages:+.1f} pages)"


def mismatches(spec: DeploymentSpec, plan: MemoryPlan, seen: Sequence[Seen]) -> list[str]:
    """One line per worker whose realized figures differ from what it was asked to realize:
    tokens by more than one page on any of its ranks, requests at all. A report for a rank
    the plan does not have (the plan changed under it) is a difference too."""
    lines = []
    for s in seen:
        ranks = plan.role(s.role).ranks
        diffs: list[str] = []
        for rank in s.pp_ranks:
            if rank >= len(ranks):
                diffs.append(f"PP rank {rank} is not in the plan ({len(ranks)} ranks)")
                continue
            want = pinned(spec, plan, s.role, rank)
            found = [
                _tokens("fullTokens", s.full_tokens, want.full_tokens, want.page_size),
                None
                if s.swa_tokens is None
                else _tokens("swaTokens", s.swa_tokens, want.swa_tokens, want.page_size),
                None
                if s.max_running_requests in (None, want.max_running_requests)
                else f"maxRunningRequests {s.max_running_requests} realized, "
                f"{want.max_running_requests} planned",
            ]
            diffs += [d for d in found if d is not None and d not in diffs]
        if diffs:
            lines.append(f"{s.worker} ({s.role}, {s.ranks_text()}): {'; '.join(diffs)}")
    return lines
