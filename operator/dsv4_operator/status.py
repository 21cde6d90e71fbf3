"""The DSV4Deployment status, computed purely from the spec, the memory plan and what was
observed: `observedGeneration`, conditions (metav1.Condition shape), readiness per role, the
per-rank plan (planned and observed), the largest context that fits, and the endpoint.

A condition keeps its `lastTransitionTime` while its status is unchanged, so summarizing an
unchanged world twice yields equal dicts and the reconciler writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_operator import labels as L
from dsv4_operator.capacity import CAPACITY_KEYS, Seen, mismatches, seen_capacity
from dsv4_operator.flavors import flavor_of
from dsv4_operator.groups import GroupAction, GroupPlan, GroupState
from dsv4_operator.observe import Observed
from dsv4_operator.restarts import RestartRecord, records_to_status

CONDITION_TYPES: Final = (
    "Ready",
    "Progressing",
    "Degraded",
    "PlanValid",
    "ContextFits",
    "WeightsReady",
    "KVTransferReady",
    "CapacityMatchesPlan",
)
# The status keys this module owns (anything else under status, e.g. kopf's, is left alone).
STATUS_KEYS: Final = (
    "observedGeneration",
    "conditions",
    "roles",
    "plan",
    "maxContextTokens",
    "endpoint",
    "restartingGroups",
    "groupRestarts",
    "autoscaling",  # written by the reconcile from autoscale.py's decision
    "weights",
)
Tri = Literal["True", "False", "Unknown"]


@dataclass(frozen=True, slots=True)
class Problem:
    """Why nothing could be planned: reason InvalidSpec or PlanFailed, message names a field."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Cond:
    type: str
    status: Tri
    reason: str
    message: str


def summarize(
    spec: DeploymentSpec | None,
    plan: MemoryPlan | None,
    observed: Observed,
    generation: int,
    *,
    meta: DeploymentMeta,
    groups: Sequence[GroupState] = (),
    group_plan: GroupPlan | None = None,
    problem: Problem | None = None,
    previous: Mapping[str, Any] | None = None,
    now: str,
    weights: Cond | None = None,
    weights_status: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`weights`: the WeightsReady condition (None: not decided, e.g. an invalid spec); when it
    is False, nothing is built yet and the status says the workers wait for the weights.
    `weights_status`: status.weights (an hf:// source)."""
    status: dict[str, Any] = {"observedGeneration": generation}
    if weights_status is not None:
        status["weights"] = dict(weights_status)
    # Pods of an outdated template realized an older plan: not compared with this one.
    stale = {p.name for g in groups for p in g.pods if p.template_hash != g.desired_hash}
    seen = seen_capacity(spec, observed, stale) if spec is not None else ()
    if spec is None or plan is None:
        assert problem is not None, "no plan without a problem"
        conds = _rejected(problem)
    elif not plan.context_fits:
        conds = _rejected(Problem("ContextTooLong", plan.context_message()), plan=plan)
        status["maxContextTokens"] = plan.max_context_tokens
        status["plan"] = _plan_entries(plan, seen)
    elif weights is not None and weights.status != "True":
        conds = _waiting_for_weights(plan, weights)
        status["maxContextTokens"] = plan.max_context_tokens
        status["plan"] = _plan_entries(plan, seen)
    else:
        roles = _roles(spec, groups, observed)
        status["roles"] = roles
        status["plan"] = _plan_entries(plan, seen)
        status["maxContextTokens"] = plan.max_context_tokens
        if observed.router_ready_replicas > 0:
            status["endpoint"] = f"http://{L.router_name(meta.name)}.{meta.namespace}.svc:" + str(
                spec.router.port
            )
        actions = group_plan.actions if group_plan is not None else ()
        records = group_plan.records if group_plan is not None else ()
        restarting = _restarting(groups, actions, previous or {})
        if restarting:
            status["restartingGroups"] = restarting
        if records:
            status["groupRestarts"] = records_to_status(records)
        health = _Health(
            actions=tuple(actions),
            restarting=tuple(restarting),
            failed=_failed(groups, records),
            waiting=dict(group_plan.waiting) if group_plan is not None else {},
        )
        conds = _serving(spec, plan, groups, observed, seen, roles, health)
    conds = _with_weights(conds, weights)
    status["conditions"] = merge_conditions(
        conds, (previous or {}).get("conditions") or [], generation, now
    )
    return status


def _with_weights(conds: list[Cond], weights: Cond | None) -> list[Cond]:
    """WeightsReady in its place (CONDITION_TYPES order)."""
    cond = weights or Cond("WeightsReady", "Unknown", "NotPlanned", "no plan")
    out = [c for c in conds if c.type != "WeightsReady"]
    out.insert(CONDITION_TYPES.index("WeightsReady"), cond)
    return out


def _waiting_for_weights(plan: MemoryPlan, weights: Cond) -> list[Cond]:
    """Planned and fitting, but an hf:// source is not complete (or failed): no worker object
    is built or changed yet; running workers (an older revision) are left alone."""
    failed = weights.reason not in ("Downloading", "Resolving", "HubUnavailable")
    return [
        Cond("Ready", "False", "WeightsNotReady", weights.message),
        Cond("Progressing", "False", "WeightsFailed", weights.message)
        if failed
        else Cond("Progressing", "True", "DownloadingWeights", weights.message),
        Cond("Degraded", "Unknown", "NotPlanned", "no workers until the weights are ready"),
        Cond("PlanValid", "True", "Planned", _plan_summary(plan)),
        Cond("ContextFits", "True", "Fits", plan.context_message())
        if plan.context_fits
        else Cond("ContextFits", "False", "ContextTooLong", plan.context_message()),
        weights,
        Cond("KVTransferReady", "Unknown", "NotStarted", "no workers until the weights are ready"),
        Cond(
            "CapacityMatchesPlan", "Unknown", "NotStarted", "no workers until the weights are ready"
        ),
    ]


def merge_conditions(
    new: Sequence[Cond], previous: Sequence[Mapping[str, Any]], generation: int, now: str
) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous if isinstance(c, Mapping)}
    out = []
    for c in new:
        old = before.get(c.type)
        unchanged = old is not None and old.get("status") == c.status
        out.append(
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": old.get("lastTransitionTime", now)
                if unchanged and old
                else now,
                "observedGeneration": generation,
            }
        )
    return out


def _rejected(problem: Problem, plan: MemoryPlan | None = None) -> list[Cond]:
    """Nothing (new) is applied: existing workers, if any, are left as they were."""
    fits = problem.reason == "ContextTooLong"
    return [
        Cond("Ready", "False", problem.reason, problem.message),
        Cond("Progressing", "False", "SpecRejected", "fix the spec; no worker object applied"),
        Cond("Degraded", "Unknown", "NotPlanned", "no plan to compare against"),
        Cond("PlanValid", "True", "Planned", _plan_summary(plan))
        if fits and plan is not None
        else Cond("PlanValid", "False", problem.reason, problem.message),
        Cond("ContextFits", "False", "ContextTooLong", problem.message)
        if fits
        else Cond("ContextFits", "Unknown", "NotPlanned", "no memory plan"),
        Cond("KVTransferReady", "Unknown", "NotPlanned", "no workers planned"),
        Cond("CapacityMatchesPlan", "Unknown", "NotPlanned", "no plan to compare against"),
    ]


def _plan_summary(plan: MemoryPlan | None) -> str:
    if plan is None:
        return ""
    parts = []
    for role in L.WORKER_ROLES:
        p = plan.role(role)
        parts.append(
            f"{role}: PP {p.inputs.pp_size} x TP {p.inputs.tp_size}, "
            f"{p.max_running_requests} requests, up to {p.max_context_tokens} tokens"
        )
    return "; ".join(parts)


def _roles(
    spec: DeploymentSpec, groups: Sequence[GroupState], observed: Observed
) -> dict[str, dict[str, Any]]:
    """Ready groups per role, surge groups of a roll included (at most `replicas`)."""
    out: dict[str, dict[str, Any]] = {}
    for role in L.WORKER_ROLES:
        want = spec.role(role).replicas
        ready = min(want, sum(1 for g in groups if g.role == role and g.ready))
        out[role] = {"replicas": want, "readyReplicas": ready, "ready": f"{ready}/{want}"}
    want, ready = spec.router.replicas, min(observed.router_ready_replicas, spec.router.replicas)
    out["router"] = {"replicas": want, "readyReplicas": ready, "ready": f"{ready}/{want}"}
    return out


def _observed_for(role: str, rank: int, seen: Sequence[Seen]) -> dict[str, int] | None:
    """The least over the replicas of what the rank realized (a figure no replica reports is
    left out)."""
    mine = [s for s in seen if s.role == role and rank in s.pp_ranks]
    if not mine:
        return None
    out: dict[str, int] = {}
    for name, key in CAPACITY_KEYS.items():
        if figures := [f for s in mine if (f := s.figure(name)) is not None]:
            out[key] = min(figures)
    return out


def _plan_entries(plan: MemoryPlan, seen: Sequence[Seen]) -> list[dict[str, Any]]:
    entries = []
    for role in L.WORKER_ROLES:
        p = plan.role(role)
        for r in p.ranks:
            entry: dict[str, Any] = {
                "role": role,
                "ppRank": r.pp_rank,
                "layers": [r.layers[0], r.layers[1]],
                "bytesPerFullToken": round(r.layout.bytes_per_full_token, 2),
                "bytesPerSwaToken": round(r.layout.bytes_per_swa_token, 2),
                "bytesPerRequest": r.layout.bytes_per_request_slot,
                "weightBytes": r.weight_bytes,
                "kvBytes": r.pools.kv_bytes,
                **{key: getattr(r.capacity, name) for name, key in CAPACITY_KEYS.items()},
                "bottleneck": r.pp_rank == p.bottleneck_rank,
            }
            if (realized := _observed_for(role, r.pp_rank, seen)) is not None:
                entry["observed"] = realized
            entries.append(entry)
    return entries


def _kv_transfer(spec: DeploymentSpec, reports: Mapping[str, WorkerStatus]) -> Cond:
    backend = spec.kv.transfer
    if (unreported := flavor_of(spec).kv_transfer_unreported(backend)) is not None:
        # NOTE: the workers publish nothing of it: Unknown, and Ready does not wait on it.
        return Cond("KVTransferReady", "Unknown", "NotReported", unreported)
    wrong = sorted(n for n, r in reports.items() if r.kv_backend not in (None, backend))
    if wrong:
        return Cond(
            "KVTransferReady",
            "False",
            "BackendMismatch",
            f"spec.kv.transfer is {backend} but {', '.join(wrong)} report another backend",
        )
    hashes = {r.kv_layout_hash for r in reports.values() if r.kv_layout_hash}
    if len(hashes) > 1:
        return Cond(
            "KVTransferReady",
            "False",
            "LayoutMismatch",
            f"workers disagree on the KV layout ({', '.join(sorted(hashes))}): prefill and "
            "decode would exchange incompatible KV",
        )
    waiting = [
        role
        for role in L.WORKER_ROLES
        if not any(r.kv_ready and r.role == role for r in reports.values())
    ]
    if waiting:
        return Cond(
            "KVTransferReady",
            "False",
            "WaitingForWorkers",
            f"no {' or '.join(waiting)} worker reports a ready {backend} transfer engine yet",
        )
    return Cond(
        "KVTransferReady",
        "True",
        "HandshakeComplete",
        f"prefill and decode report {backend} ready on one KV layout",
    )


def _restarting(
    groups: Sequence[GroupState], actions: Sequence[GroupAction], previous: Mapping[str, Any]
) -> list[str]:
    """Groups restarted now or by an earlier reconcile (remembered in status) that are not
    ready again. A group that no longer exists (replicas lowered) is dropped."""
    before = previous.get("restartingGroups") or []
    marked = {a.group for a in actions if a.restart} | {g for g in before if isinstance(g, str)}
    return sorted(g.name for g in groups if g.name in marked and not g.ready)


@dataclass(frozen=True, slots=True)
class _Health:
    """What the group plan says about broken groups, for Degraded."""

    actions: tuple[GroupAction, ...]
    restarting: tuple[str, ...]  # restarted, not ready again
    failed: tuple[RestartRecord, ...]  # restart budget spent, not ready
    waiting: Mapping[str, float]  # broken, backing off: seconds left


def _failed(
    groups: Sequence[GroupState], records: Sequence[RestartRecord]
) -> tuple[RestartRecord, ...]:
    healthy = {g.name for g in groups if g.ready and g.broken() is None}
    return tuple(r for r in records if r.failed and r.group not in healthy)


def _degraded(spec: DeploymentSpec, health: _Health, seen: Sequence[Seen]) -> Cond:
    if health.failed:
        return Cond(
            "Degraded",
            "True",
            "GroupFailed",
            "; ".join(
                f"{r.group} failed: left down after {r.restarts} restart(s) "
                f"(spec.groupRestarts.budget {spec.group_restarts.budget}); fix the cause, "
                "then edit the spec or delete the group's pods"
                for r in health.failed
            ),
        )
    if health.restarting or health.waiting:
        now = {a.group: a.message for a in health.actions if a.restart}
        parts = [
            f"{g} restarted as a unit: {now[g]}" if g in now else f"{g} is re-forming"
            for g in health.restarting
            if g not in health.waiting
        ]
        parts += [
            f"{g} is broken; restart backs off {left:.0f} s more"
            for g, left in sorted(health.waiting.items())
        ]
        return Cond("Degraded", "True", "GroupRestarted", "; ".join(parts))
    short = sorted(
        s.worker for s in seen if s.capacity.max_context_tokens < spec.max_context_tokens
    )
    if short:
        return Cond(
            "Degraded",
            "True",
            "CapacityBelowPlan",
            f"{', '.join(short)} realized less KV than planned: they hold fewer than "
            f"maxContextTokens {spec.max_context_tokens} tokens",
        )
    return Cond("Degraded", "False", "AsExpected", "")


def _serving(
    spec: DeploymentSpec,
    plan: MemoryPlan,
    groups: Sequence[GroupState],
    observed: Observed,
    seen: Sequence[Seen],
    roles: Mapping[str, Mapping[str, Any]],
    health: _Health,
) -> list[Cond]:
    kv = _kv_transfer(spec, observed.reports)
    missing = [r for r in (*L.WORKER_ROLES, "router") if roles[r]["readyReplicas"] == 0]
    counts = ", ".join(f"{r} {roles[r]['ready']}" for r in (*L.WORKER_ROLES, "router"))
    if missing:
        reason = f"{missing[0].capitalize()}NotReady"
        ready = Cond("Ready", "False", reason, f"ready: {counts}")
    elif kv.status == "False":
        ready = Cond("Ready", "False", "KVTransferNotReady", kv.message)
    else:
        ready = Cond(
            "Ready",
            "True",
            "Serving",
            f"ready: {counts}; up to {plan.max_context_tokens} tokens of context",
        )
    rolling = [a.group for a in health.actions if not a.restart]
    rolling += [g.name for g in groups if g.outdated or g.surge]
    starting = [g.name for g in groups if not g.ready]
    if rolling:
        progressing = Cond(
            "Progressing", "True", "Rolling", f"rolling: {', '.join(sorted(set(rolling)))}"
        )
    elif starting or any(roles[r]["readyReplicas"] < roles[r]["replicas"] for r in roles):
        progressing = Cond("Progressing", "True", "Starting", f"ready: {counts}")
    else:
        progressing = Cond("Progressing", "False", "Complete", f"ready: {counts}")
    return [
        ready,
        progressing,
        _degraded(spec, health, seen),
        Cond("PlanValid", "True", "Planned", _plan_summary(plan)),
        Cond("ContextFits", "True", "Fits", plan.context_message()),
        kv,
        _capacity_matches(spec, plan, observed, seen),
    ]


def _capacity_matches(
    spec: DeploymentSpec, plan: MemoryPlan, observed: Observed, seen: Sequence[Seen]
) -> Cond:
    """False when a worker realized other figures than it was asked to (capacity.mismatches);
    else Unknown while a role has no report (or a report could not be read); else True."""
    source = flavor_of(spec).capacity_source
    differ = mismatches(spec, plan, seen)
    if differ:
        return Cond(
            "CapacityMatchesPlan",
            "False",
            "CapacityDiffers",
            "; ".join(differ) + " (tolerance: one page of tokens per rank)",
        )
    missing = [role for role in L.WORKER_ROLES if not any(s.role == role for s in seen)]
    if observed.unreadable or missing:
        parts = [f"{pod}: {why}" for pod, why in sorted(observed.unreadable.items())]
        if missing:
            parts.append(f"no {' or '.join(missing)} worker has answered {source} yet")
        return Cond("CapacityMatchesPlan", "Unknown", "NotObserved", "; ".join(parts))
    return Cond(
        "CapacityMatchesPlan",
        "True",
        "AsPlanned",
        f"{len(seen)} worker(s) realized the plan within a page per rank ({source})",
    )
