"""Realized capacity next to the plan, for either engine. Pure.

- engine dsv4: each worker reports its own rank's figures on `/status` (one `Seen` per pod).
- engine sglang: PP rank 0 of a group answers `/server_info` for the whole group (SGLang sizes
  every rank's pool to the least over the ranks), so one `Seen` covers every rank.

What a worker was asked to realize (`pinned`, from the engine's flavor): for our worker, its
rank's plan (`rank_pinned`); for SGLang, the figures the operator put on its command line
(`flavors.sglang.command.group_figures`), the same on every rank. A realized figure that
differs from it by more than one page (`mismatches`) means the plan did not predict the
engine: a GPU with less free memory than `spec.gpu` says, memory taken before the pools were
sized, or an engine version that prices KV differently.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from dsv4_common.api import RankCapacity
from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.spec import DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.flavors import flavor_of
from dsv4_operator.flavors.sglang.info import ServerInfo
from dsv4_operator.observe import Observed

Figure = Literal["full_tokens", "swa_tokens", "max_running_requests", "max_context_tokens"]
# The key of each RankCapacity figure in the CR's status (`status.plan[]` and its `observed`).
CAPACITY_KEYS: Final[Mapping[Figure, str]] = {
    "full_tokens": "fullTokens",
    "swa_tokens": "swaTokens",
    "max_running_requests": "maxRunningRequests",
    "max_context_tokens": "maxContextTokens",
}


@dataclass(frozen=True, slots=True)
class Seen:
    """One worker's realized capacity, for the PP ranks it speaks for."""

    worker: str  # the pod that reported it
    role: L.WorkerRole
    pp_ranks: tuple[int, ...]
    capacity: RankCapacity
    # Figures its engine does not report (SGLang may leave out its SWA pool and request
    # count): their value in `capacity` is 0 and is never compared or shown.
    unreported: frozenset[Figure] = frozenset()

    def figure(self, name: Figure) -> int | None:
        """A realized figure; None: not reported."""
        value: int = getattr(self.capacity, name)
        return None if name in self.unreported else value

    def ranks_text(self) -> str:
        first, last = self.pp_ranks[0], self.pp_ranks[-1]
        return f"PP rank {first}" if first == last else f"PP ranks {first}-{last}"


@dataclass(frozen=True, slots=True)
class Pinned:
    """What a rank was asked to realize (its max context is not compared)."""

    capacity: RankCapacity
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
                capacity=r.capacity,
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
                capacity=_capacity_of(info),
                unreported=_unreported_by(info),
            )
        )
    return tuple(sorted(out, key=lambda s: s.worker))


def _capacity_of(info: ServerInfo) -> RankCapacity:
    return RankCapacity(
        full_tokens=info.full_tokens,
        swa_tokens=info.swa_tokens or 0,
        max_running_requests=info.max_running_requests or 0,
        max_context_tokens=info.max_context_tokens,
    )


def _unreported_by(info: ServerInfo) -> frozenset[Figure]:
    missing: dict[Figure, int | None] = {
        "swa_tokens": info.swa_tokens,
        "max_running_requests": info.max_running_requests,
    }
    return frozenset(name for name, value in missing.items() if value is None)


def pinned(spec: DeploymentSpec, plan: MemoryPlan, role: L.WorkerRole, pp_rank: int) -> Pinned:
    """What the rank was asked to realize, as the spec's engine flavor says."""
    return flavor_of(spec).pinned(plan, role, pp_rank)


def rank_pinned(plan: MemoryPlan, role: L.WorkerRole, pp_rank: int) -> Pinned:
    """The rank's own plan (a worker that sizes each rank's pools for that rank)."""
    role_plan = plan.role(role)
    return Pinned(role_plan.ranks[pp_rank].capacity, role_plan.inputs.resolved_page_size)


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
            planned = want.capacity
            swa, requests = s.figure("swa_tokens"), s.figure("max_running_requests")
            found = [
                _tokens("fullTokens", s.capacity.full_tokens, planned.full_tokens, want.page_size),
                None
                if swa is None
                else _tokens("swaTokens", swa, planned.swa_tokens, want.page_size),
                None
                if requests in (None, planned.max_running_requests)
                else f"maxRunningRequests {requests} realized, "
                f"{planned.max_running_requests} planned",
            ]
            diffs += [d for d in found if d is not None and d not in diffs]
        if diffs:
            lines.append(f"{s.worker} ({s.role}, {s.ranks_text()}): {'; '.join(diffs)}")
    return lines
