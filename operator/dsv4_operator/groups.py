"""PP-group semantics, decided purely from observed pods: which groups are ready, which must be
restarted as a unit, which may roll to a new template now.

  restart  a pod of the group failed (phase Failed), restarted (restartCount > 0), or was
           replaced while its peers kept running (a live pod created after a peer's container
           had started; the StatefulSet recreating a deleted pod looks like this). The group's
           pipeline is broken either way, so every pod is deleted and the group re-forms.
  roll     the group's pods carry an old template hash (OnDelete StatefulSets never replace
           pods themselves). An unready group rolls at once; a ready one only when every other
           group of its role is ready, so a role loses at most one group (the PDB's budget).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from dsv4_common.api.spec import DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.observe import PodState

Reason = Literal["PodFailed", "PodRestarted", "PodReplaced", "Outdated"]


@dataclass(frozen=True, slots=True)
class GroupState:
    name: str
    role: L.WorkerRole
    replica: int
    pp_size: int
    desired_hash: str
    pods: tuple[PodState, ...]  # live pods (not terminating)

    @property
    def ready(self) -> bool:
        ranks = {p.pp_rank for p in self.pods if p.ready}
        return len(self.pods) == self.pp_size and ranks == set(range(self.pp_size))

    @property
    def outdated(self) -> bool:
        return any(p.template_hash != self.desired_hash for p in self.pods)

    def broken(self) -> tuple[Reason, str] | None:
        for p in self.pods:
            if p.phase == "Failed":
                return "PodFailed", f"pod {p.name} failed"
        for p in self.pods:
            if p.restart_count > 0:
                return "PodRestarted", f"pod {p.name} restarted {p.restart_count} time(s)"
        for late in self.pods:
            for peer in self.pods:
                if (
                    late.created_at is not None
                    and peer.started_at is not None
                    and late.created_at > peer.started_at
                ):
                    return "PodReplaced", f"pod {late.name} was replaced while {peer.name} ran"
        return None


@dataclass(frozen=True, slots=True)
class GroupAction:
    """Delete every pod of `group` (its StatefulSet recreates them at the current template)."""

    group: str
    role: L.WorkerRole
    reason: Reason
    message: str

    @property
    def restart(self) -> bool:
        return self.reason != "Outdated"


def group_states(
    spec: DeploymentSpec,
    name: str,
    template_hashes: Mapping[str, str],
    pods: Iterable[PodState],
) -> list[GroupState]:
    live = [p for p in pods if not p.deleting]
    out: list[GroupState] = []
    for role in L.WORKER_ROLES:
        for replica in range(spec.role(role).replicas):
            group = L.group_name(name, role, replica)
            out.append(
                GroupState(
                    name=group,
                    role=role,
                    replica=replica,
                    pp_size=spec.role(role).pipeline_parallel,
                    desired_hash=template_hashes[group],
                    pods=tuple(sorted((p for p in live if p.group == group), key=lambda p: p.name)),
                )
            )
    return out


def plan_group_actions(groups: list[GroupState]) -> list[GroupAction]:
    actions: list[GroupAction] = []
    for g in groups:
        if (why := g.broken()) is not None:
            actions.append(GroupAction(g.name, g.role, why[0], why[1]))
    acted = {a.group for a in actions}
    for role in L.WORKER_ROLES:
        mine = [g for g in groups if g.role == role]
        for g in mine:
            if g.name not in acted and g.outdated and not g.ready:
                actions.append(GroupAction(g.name, role, "Outdated", f"{g.name} rolls (unready)"))
                acted.add(g.name)
        if all(g.ready and g.name not in acted for g in mine):
            ready_outdated = [g for g in mine if g.outdated]
            if ready_outdated:
                g = ready_outdated[0]
                actions.append(GroupAction(g.name, role, "Outdated", f"{g.name} rolls"))
    return actions
