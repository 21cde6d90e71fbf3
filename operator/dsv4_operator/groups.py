"""PP groups as observed, and what to do about them, decided purely: which groups are ready,
which are broken and restart as a unit (with backoff and a budget: `restarts.py`), which roll to
a new template and how many surge groups the roll runs (`rollout.py`).

A group is one StatefulSet whose pods are its PP ranks. A role's groups are its `replicas`
regular groups (indices 0..replicas-1) plus, while it rolls, surge groups at the indices after
them. Acting on a group means deleting all its pods: its StatefulSet (OnDelete) recreates them
at its current template, so a group never runs mixed template versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from dsv4_common.api.spec import DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.observe import PodState
from dsv4_operator.restarts import RestartRecord, plan_restarts
from dsv4_operator.rollout import plan_rollout

Reason = Literal["PodFailed", "PodRestarted", "PodReplaced", "Outdated"]


@dataclass(frozen=True, slots=True)
class GroupState:
    name: str
    role: L.WorkerRole
    replica: int  # the group's index; >= the role's replicas for a surge group
    pp_size: int
    desired_hash: str
    pods: tuple[PodState, ...]  # live pods (not terminating)
    surge: bool = False

    @property
    def ready(self) -> bool:
        ranks = {p.pp_rank for p in self.pods if p.ready}
        return len(self.pods) == self.pp_size and ranks == set(range(self.pp_size))

    @property
    def outdated(self) -> bool:
        return any(p.template_hash != self.desired_hash for p in self.pods)

    @property
    def settled(self) -> bool:
        """Ready at the current template: what a roll waits for."""
        return self.ready and not self.outdated

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


@dataclass(frozen=True, slots=True)
class GroupPlan:
    actions: tuple[GroupAction, ...]
    surge: Mapping[L.WorkerRole, int]  # surge groups each role keeps (indices after replicas)
    records: tuple[RestartRecord, ...]  # the restart memory to keep in status
    failed: tuple[str, ...]  # groups whose restart budget ran out in this reconcile
    waiting: Mapping[str, float]  # broken groups backing off -> seconds until their restart


def group_states(
    spec: DeploymentSpec,
    name: str,
    template_hashes: Mapping[str, str],
    pods: Iterable[PodState],
    surge: Mapping[L.WorkerRole, int] | None = None,
) -> list[GroupState]:
    """The regular groups of each role, then its `surge[role]` surge groups.
    `template_hashes` must hold every one of them."""
    live = [p for p in pods if not p.deleting]
    out: list[GroupState] = []
    for role in L.WORKER_ROLES:
        replicas = spec.role(role).replicas
        for replica in range(replicas + (surge or {}).get(role, 0)):
            group = L.group_name(name, role, replica)
            out.append(
                GroupState(
                    name=group,
                    role=role,
                    replica=replica,
                    pp_size=spec.role(role).pipeline_parallel,
                    desired_hash=template_hashes[group],
                    pods=tuple(sorted((p for p in live if p.group == group), key=lambda p: p.name)),
                    surge=replica >= replicas,
                )
            )
    return out


def plan_groups(
    spec: DeploymentSpec,
    groups: Sequence[GroupState],
    previous: Sequence[RestartRecord],
    now: datetime,
) -> GroupPlan:
    """Restarts first (a broken group is not serving; its backoff and budget apply), then the
    roll of outdated groups around them. A broken outdated group rolls instead of restarting."""
    broken = {g.name: why for g in groups if (why := g.broken()) is not None}
    rolling_broken = {g.name for g in groups if g.name in broken and g.outdated}
    restarts = plan_restarts(
        [g for g in groups if g.name in broken and g.name not in rolling_broken],
        groups,
        previous,
        spec.group_restarts,
        now,
    )
    role = {g.name: g.role for g in groups}
    actions = [GroupAction(g, role[g], broken[g][0], broken[g][1]) for g in restarts.restart]
    down = set(broken)  # restarted, backing off or failed: none of them serves
    roll = plan_rollout(spec, groups, down)
    for group, message in roll.delete:
        actions.append(GroupAction(group, role[group], "Outdated", message))
    return GroupPlan(
        actions=tuple(actions),
        surge=roll.surge,
        records=restarts.records,
        failed=restarts.newly_failed,
        waiting=restarts.waiting,
    )
