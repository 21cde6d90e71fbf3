"""Restarts of broken PP groups, with exponential backoff and a budget. Pure.

The memory is a `RestartRecord` per group, kept in the CR's status (`status.groupRestarts`):
how many restarts, when the last one was, at which template. Rules, for a broken group that
has had `n` restarts:
  n >= budget                       left failed: no restart (the kubelet may still restart its
                                    containers; the operator no longer re-forms the group)
  n == 0                            restart now
  now < last + backoff * 2^(n-1)    wait (capped at maxBackoffSeconds)
  otherwise                         restart now; n + 1
A record is forgotten (a fresh budget) when its group is ready and not broken
`resetAfterSeconds` after its last restart, when the group's template changed (a spec edit may
be the fix), or when the group is gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dsv4_common.api.spec import GroupRestartSpec

if TYPE_CHECKING:
    from dsv4_operator.groups import GroupState


@dataclass(frozen=True, slots=True)
class RestartRecord:
    group: str
    restarts: int
    last_restart: datetime
    template_hash: str
    failed: bool = False


@dataclass(frozen=True, slots=True)
class RestartPlan:
    restart: tuple[str, ...]  # groups to restart now
    records: tuple[RestartRecord, ...]  # sorted by group
    newly_failed: tuple[str, ...]  # budget spent in this reconcile (post an Event once)
    waiting: Mapping[str, float]  # group -> seconds of backoff left


def backoff_s(spec: GroupRestartSpec, restarts: int) -> float:
    """The wait after the `restarts`-th restart before the next one (0 before the first)."""
    if restarts <= 0:
        return 0.0
    return float(min(spec.backoff_seconds * 2 ** min(restarts - 1, 32), spec.max_backoff_seconds))


def plan_restarts(
    broken: Sequence[GroupState],
    groups: Sequence[GroupState],
    previous: Iterable[RestartRecord],
    spec: GroupRestartSpec,
    now: datetime,
) -> RestartPlan:
    by_name = {g.name: g for g in groups}
    down = {g.name for g in broken}
    records: dict[str, RestartRecord] = {}
    for kept in previous:
        g = by_name.get(kept.group)
        if g is None or g.desired_hash != kept.template_hash:
            continue  # gone, or a new template: a fresh budget
        healthy = g.ready and g.name not in down
        if healthy and (now - kept.last_restart).total_seconds() >= spec.reset_after_seconds:
            continue  # healthy long enough
        records[kept.group] = kept
    restart: list[str] = []
    failed: list[str] = []
    waiting: dict[str, float] = {}
    for g in broken:
        r = records.get(g.name)
        n = r.restarts if r is not None else 0
        if n >= spec.budget:
            if r is None:
                records[g.name] = RestartRecord(g.name, 0, now, g.desired_hash, failed=True)
                failed.append(g.name)
            elif not r.failed:
                records[g.name] = replace(r, failed=True)
                failed.append(g.name)
            continue
        if r is not None:
            left = backoff_s(spec, n) - (now - r.last_restart).total_seconds()
            if left > 0:
                waiting[g.name] = left
                continue
        records[g.name] = RestartRecord(g.name, n + 1, now, g.desired_hash)
        restart.append(g.name)
    return RestartPlan(
        restart=tuple(restart),
        records=tuple(records[k] for k in sorted(records)),
        newly_failed=tuple(failed),
        waiting=waiting,
    )


# --- status.groupRestarts <-> records ----------------------------------------------------------


def format_time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def records_to_status(records: Iterable[RestartRecord]) -> list[dict[str, Any]]:
    return [
        {
            "group": r.group,
            "restarts": r.restarts,
            "lastRestartTime": format_time(r.last_restart),
            "templateHash": r.template_hash,
            "failed": r.failed,
        }
        for r in records
    ]


def records_from_status(status: Mapping[str, Any]) -> list[RestartRecord]:
    """The records a previous reconcile wrote; malformed entries are dropped (a fresh budget)."""
    out = []
    for entry in status.get("groupRestarts") or []:
        if not isinstance(entry, Mapping):
            continue
        try:
            when = datetime.fromisoformat(str(entry["lastRestartTime"]).replace("Z", "+00:00"))
            out.append(
                RestartRecord(
                    group=str(entry["group"]),
                    restarts=int(entry["restarts"]),
                    last_restart=when if when.tzinfo else when.replace(tzinfo=UTC),
                    template_hash=str(entry.get("templateHash", "")),
                    failed=bool(entry.get("failed", False)),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return out
