"""Rolling a role's PP groups to a new template with surge, one decision per reconcile. Pure.

Per role, with R = replicas, S = rollout.maxSurge, U = rollout.maxUnavailable:
  surge    while a regular group is outdated, min(S, regular groups not yet settled) surge
           groups exist at the new template (indices R, R+1, ...); they are released, highest
           index first, as regular groups settle, and all go once every regular group has
  unready  an outdated group that is not ready serves nothing: it rolls at once
  ready    an outdated ready group rolls only if the role keeps at least R - U ready groups
           without it (surge groups count), so with S >= 1 and U = 0 a role never has fewer
           ready groups than replicas, one replica included
Prefill and decode are coordinated so that a compatible pair (both old or both new templates)
is always ready when the settings allow it:
  decode first   prefill starts a roll (adds surge groups, takes a ready group down) only once
                 decode has a settled group, or when decode has no ready group at all
  old decode     decode keeps its last ready outdated group while prefill still has a ready
                 outdated group and decode already has a settled one (the new pair exists)
A group that is broken (restarting, backing off or failed) is not counted as ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4_common.api.spec import DeploymentSpec
from dsv4_operator import labels as L

if TYPE_CHECKING:
    from dsv4_operator.groups import GroupState


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    surge: Mapping[L.WorkerRole, int]
    delete: tuple[tuple[str, str], ...]  # (group, why) to roll now


def plan_rollout(spec: DeploymentSpec, groups: Sequence[GroupState], down: set[str]) -> RolloutPlan:
    """`groups`: every regular group and every surge group that exists; `down`: broken groups
    (not ready, and not rolled here unless outdated)."""

    def ready(g: GroupState) -> bool:
        return g.ready and g.name not in down

    by_role = {role: [g for g in groups if g.role == role] for role in L.WORKER_ROLES}
    decode = by_role["decode"]
    decode_settled = any(ready(g) and not g.outdated for g in decode)
    decode_any_ready = any(ready(g) for g in decode)
    prefill_old_ready = any(ready(g) and g.outdated for g in by_role["prefill"])

    surge: dict[L.WorkerRole, int] = {}
    delete: list[tuple[str, str]] = []
    for role in L.WORKER_ROLES:
        mine = by_role[role]
        rollout = spec.role(role).rollout
        replicas = spec.role(role).replicas
        may_start = role == "decode" or decode_settled or not decode_any_ready
        regular = [g for g in mine if not g.surge]
        live_surge = sum(1 for g in mine if g.surge)
        pending = sum(1 for g in regular if not (ready(g) and not g.outdated))
        if pending == 0:
            surge[role] = 0
        elif any(g.outdated for g in regular) and may_start:
            surge[role] = min(rollout.max_surge, pending)
        else:
            surge[role] = min(live_surge, pending)
        keep = {g.name for g in mine if not g.surge or g.replica < replicas + surge[role]}

        for g in mine:
            if g.name in keep and g.outdated and not ready(g):
                delete.append((g.name, f"{g.name} rolls (not ready)"))
        if not may_start:
            continue
        ready_count = sum(1 for g in mine if g.name in keep and ready(g))
        old_ready = [g for g in mine if g.name in keep and ready(g) and g.outdated]
        hold_last = role == "decode" and prefill_old_ready and decode_settled
        old_left = len(old_ready)
        # Surge groups of an earlier template first: they are the extra capacity.
        for g in sorted(old_ready, key=lambda g: (not g.surge, g.replica)):
            if ready_count - 1 < replicas - rollout.max_unavailable:
                break
            if hold_last and old_left <= 1:
                break
            delete.append((g.name, f"{g.name} rolls"))
            ready_count -= 1
            old_left -= 1
    return RolloutPlan(surge=surge, delete=tuple(delete))
