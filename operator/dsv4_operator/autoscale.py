"""The operator's side of autoscaling (engine operator), pure: the groups each role runs, read
from and written to `status.autoscaling`, decided by `dsv4_common.api.scaling` from what the
workers reported (`Observed`) and the latency their /metrics histograms showed.

    effective_spec   the spec with each autoscaled role's `replicas` set to the groups it runs
                     now (status.autoscaling.<role>.replicas, clamped to its range; at first
                     its `replicas`, clamped): what the reconcile builds and rolls
    autoscale        one decision per reconcile: the spec to build, the status entry and the
                     changes to announce (one Event each)

A role's figures come only from its regular groups' pods at the current template count (a
surge group of a roll is not load the role carries); a group counts as ready when all its
ranks are Ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from dsv4_common.api.load_figures import Latency, role_figures
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.scaling import RoleDecision, RoleInput, RoleMemory, decide, with_replicas
from dsv4_common.api.spec import DeploymentSpec
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_operator import labels as L
from dsv4_operator.observe import Observed
from dsv4_operator.restarts import format_time

STATUS_KEY: Final = "autoscaling"
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Change:
    """One role's scale change: the Event the operator posts (Normal, reason ScaledUp or
    ScaledDown)."""

    role: WorkerRole
    reason: str
    before: int
    after: int
    message: str

    @property
    def text(self) -> str:
        return f"{self.role} {self.before} -> {self.after} group(s): {self.message}"


@dataclass(frozen=True, slots=True)
class Autoscaled:
    spec: DeploymentSpec  # with the decided replicas
    status: dict[str, Any] | None  # status.autoscaling (None: no role autoscales)
    changes: tuple[Change, ...] = ()


def operator_scales(spec: DeploymentSpec) -> bool:
    return spec.autoscaling.engine == "operator" and any(
        spec.role(r).autoscaling is not None for r in WORKER_ROLES
    )


def _seconds(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return (datetime.fromisoformat(text.replace("Z", "+00:00")) - _EPOCH).total_seconds()
    except ValueError:
        return None


def _time(seconds: float) -> str:
    return format_time(datetime.fromtimestamp(seconds, UTC))


def memory_from_status(entry: object) -> RoleMemory | None:
    """A role's memory as the last decision wrote it (None: unreadable or never written)."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("replicas"), int):
        return None
    history = []
    for point in entry.get("recommendations") or []:
        if isinstance(point, Mapping) and isinstance(point.get("replicas"), int):
            at = _seconds(point.get("time"))
            if at is not None:
                history.append((at, int(point["replicas"])))
    return RoleMemory(
        replicas=int(entry["replicas"]),
        last_scale_s=_seconds(entry.get("lastScaleTime")),
        last_up_s=_seconds(entry.get("lastScaleUpTime")),
        history=tuple(history),
    )


def effective_spec(spec: DeploymentSpec, previous: Mapping[str, Any]) -> DeploymentSpec:
    """The spec with each autoscaled role's replicas as it runs now."""
    if not operator_scales(spec):
        return spec
    entries = previous.get(STATUS_KEY) or {}
    out = spec
    for role in WORKER_ROLES:
        auto = spec.role(role).autoscaling
        if auto is None:
            continue
        memory = memory_from_status(entries.get(role) if isinstance(entries, Mapping) else None)
        replicas = auto.clamp(memory.replicas if memory is not None else spec.role(role).replicas)
        out = with_replicas(out, role, replicas)
    return out


def reports_by_group(
    spec: DeploymentSpec, name: str, observed: Observed
) -> dict[WorkerRole, dict[str, list[WorkerStatus]]]:
    """Each role's regular groups -> the /status reports of their ranks."""
    pod_group = {p.name: p.group for p in observed.pods if not p.deleting}
    out: dict[WorkerRole, dict[str, list[WorkerStatus]]] = {}
    for role in WORKER_ROLES:
        groups: dict[str, list[WorkerStatus]] = {
            L.group_name(name, role, i): [] for i in range(spec.role(role).replicas)
        }
        for pod, report in sorted(observed.reports.items()):
            group = pod_group.get(pod)
            if group in groups and report.role == role:
                groups[group].append(report)
        out[role] = groups
    return out


def ready_groups(spec: DeploymentSpec, name: str, observed: Observed) -> dict[WorkerRole, int]:
    out: dict[WorkerRole, int] = {}
    for role in WORKER_ROLES:
        pp = spec.role(role).pipeline_parallel
        count = 0
        for i in range(spec.role(role).replicas):
            group = L.group_name(name, role, i)
            ranks = {p.pp_rank for p in observed.pods if p.group == group and p.ready}
            count += ranks == set(range(pp))
        out[role] = count
    return out


def autoscale(
    spec: DeploymentSpec,
    name: str,
    observed: Observed,
    previous: Mapping[str, Any],
    now: datetime,
    latency: Mapping[WorkerRole, Latency] | None = None,
) -> Autoscaled:
    """One decision: `spec` as parsed (its roles' `replicas` as written), `observed` the
    workers now, `previous` the CR's status."""
    if not operator_scales(spec):
        return Autoscaled(spec, None)
    running = effective_spec(spec, previous)
    entries = previous.get(STATUS_KEY) or {}
    reports = reports_by_group(running, name, observed)
    ready = ready_groups(running, name, observed)
    now_s = float(int((now - _EPOCH).total_seconds()))  # whole seconds, as status keeps them
    inputs = {
        role: RoleInput(
            replicas=spec.role(role).replicas,
            autoscaling=spec.role(role).autoscaling,
            memory=memory_from_status(entries.get(role) if isinstance(entries, Mapping) else None),
            figures=role_figures(reports[role], (latency or {}).get(role)),
            ready=ready[role],
        )
        for role in WORKER_ROLES
    }
    decisions = decide(inputs, spec.autoscaling, now_s)
    out = spec
    status: dict[str, Any] = {}
    changes: list[Change] = []
    for role in WORKER_ROLES:
        d = decisions[role]
        if spec.role(role).autoscaling is None:
            continue
        out = with_replicas(out, role, d.replicas)
        status[role] = _entry(d, inputs[role])
        before = running.role(role).replicas
        if d.replicas != before:
            changes.append(Change(role, d.reason, before, d.replicas, d.message))
    return Autoscaled(out, status, tuple(changes))


def _entry(d: RoleDecision, inp: RoleInput) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "replicas": d.replicas,
        "desired": d.target,
        "reason": d.reason,
        "message": d.message[:1024],
    }
    if d.recommended is not None:
        entry["recommended"] = d.recommended
    f = inp.figures
    if f is not None:
        figures: dict[str, Any] = {"groups": f.groups, "queueDepth": f.queue_depth}
        if f.kv_utilization is not None:
            figures["kvUtilization"] = round(f.kv_utilization, 4)
        if f.binding_pool is not None:
            figures["bindingPool"] = f.binding_pool
        if f.ttft_s is not None:
            figures["ttftSeconds"] = round(f.ttft_s, 4)
        if f.inter_token_latency_s is not None:
            figures["interTokenLatencySeconds"] = round(f.inter_token_latency_s, 4)
        entry["figures"] = figures
    m = d.memory
    if m.last_scale_s is not None:
        entry["lastScaleTime"] = _time(m.last_scale_s)
    if m.last_up_s is not None:
        entry["lastScaleUpTime"] = _time(m.last_up_s)
    if m.history:
        entry["recommendations"] = [{"time": _time(t), "replicas": n} for t, n in m.history]
    return entry


def scaled_roles(changes: Sequence[Change]) -> str:
    return ", ".join(c.text for c in changes)
