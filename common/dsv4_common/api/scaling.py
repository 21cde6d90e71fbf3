"""The autoscaling decision: each role's figures and memory in, the groups each role runs out.
Pure (the clock is an argument); the operator and `dsv4 up` carry it out.

Per autoscaled role, in order:

    1 recommend     the most any target asks for: queue depth / target per replica, or
                    groups x figure / target (KV utilisation of the binding pool, TTFT, ITL);
                    a figure within TOLERANCE of its target asks for no change
    2 stabilize     up at once; down only to the highest recommendation of the last
                    `stabilization_s` (a dip does not shrink the role); clamped to the range
    3 guard         no change within `cooldown_s` of the last one; no scale-down within
                    `stabilization_s` of the last scale-up

Then both roles together (`spec.autoscaling`):

    4 coordinate    the wanted pair is moved into the prefill:decode ratio band, raising the
                    role that lags (decode first, for what prefill needs), within the ranges
    5 step          the pair moves towards it, staying within the band widened by `max_skew`
                    groups, and a role grows past that only as far as the other role's READY
                    groups allow: P and D never drift apart beyond `max_skew`

NOTE (the properties `test_scaling.py` checks for any figures): every count stays in its
range; a pair within the widened band stays within it; a role never changes twice within
its cooldown nor scales down within its window after a scale-up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final, Literal

from dsv4_common.api.autoscaling_spec import AutoscalingSpec, RatioBand, RoleAutoscaling
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.spec import DeploymentSpec

TOLERANCE: Final = 0.1  # a figure within 10% of its target asks for no change (as the HPA)
MAX_HISTORY: Final = 64  # recommendation change points kept (the window's, at most)

Reason = Literal[
    "ScaledUp",
    "ScaledDown",
    "Steady",
    "NoFigures",
    "HeldByCooldown",
    "HeldByWindow",
    "HeldBySkew",
    "Fixed",
]


@dataclass(frozen=True, slots=True)
class RoleFigures:
    """What a role's groups report now (`load_figures.role_figures`)."""

    groups: int  # groups that reported
    queue_depth: int = 0  # requests waiting, summed over them
    kv_utilization: float | None = None  # mean of each group's binding pool utilisation
    binding_pool: str | None = None  # the pool that binds in the fullest group
    ttft_s: float | None = None
    inter_token_latency_s: float | None = None


@dataclass(frozen=True, slots=True)
class RoleMemory:
    """What the decision remembers of a role between calls (status.autoscaling.<role>)."""

    replicas: int
    last_scale_s: float | None = None
    last_up_s: float | None = None
    # (time, recommended groups) at each change of the recommendation, oldest first.
    history: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RoleInput:
    replicas: int  # the role's `replicas` (its count when not autoscaled; else the start)
    autoscaling: RoleAutoscaling | None
    memory: RoleMemory | None  # None: the first decision
    figures: RoleFigures | None  # None: no group reported
    ready: int = 0  # groups ready now (what a role may grow past the band on)

    def bounds(self) -> tuple[int, int]:
        a = self.autoscaling
        return (self.replicas, self.replicas) if a is None else (a.min_replicas, a.max_replicas)

    def current(self) -> int:
        lo, hi = self.bounds()
        base = self.memory.replicas if self.memory is not None else self.replicas
        return max(lo, min(hi, base))


@dataclass(frozen=True, slots=True)
class RoleDecision:
    replicas: int  # the groups the role runs from now
    wanted: int  # what its own figures ask for, stabilized and guarded
    target: int  # the coordinated goal (the band's), `replicas` moves towards it
    recommended: int | None  # step 1's answer (None: no figures)
    reason: Reason
    message: str  # the figure that decided it, for the Event and status
    memory: RoleMemory
    changed: bool = False  # replicas differ from the groups the role ran before


def recommend(
    auto: RoleAutoscaling, current: int, figures: RoleFigures | None
) -> tuple[int, str] | None:
    """Step 1: (groups, the figure that asks for the most), or None without figures."""
    if figures is None or figures.groups == 0:
        return None
    t = auto.targets
    asks: list[tuple[int, str]] = []

    def proportional(value: float, target: float, what: str) -> None:
        ratio = value / target
        want = current if abs(ratio - 1) <= TOLERANCE else math.ceil(figures.groups * ratio)
        asks.append((want, f"{what} {value:.3g} against {target:.3g} on {figures.groups} group(s)"))

    if t.queue_depth_per_replica is not None:
        per = figures.queue_depth / max(1, figures.groups)
        ratio = per / t.queue_depth_per_replica
        want = (
            current
            if abs(ratio - 1) <= TOLERANCE
            else math.ceil(figures.queue_depth / t.queue_depth_per_replica)
        )
        asks.append(
            (
                want,
                f"queue depth {figures.queue_depth} against {t.queue_depth_per_replica} per "
                f"group on {figures.groups} group(s)",
            )
        )
    if t.kv_utilization is not None and figures.kv_utilization is not None:
        pool = f" ({figures.binding_pool} pool binds)" if figures.binding_pool else ""
        proportional(figures.kv_utilization, t.kv_utilization, f"KV utilisation{pool}")
    if t.ttft_s is not None and figures.ttft_s is not None:
        proportional(figures.ttft_s, t.ttft_s, f"TTFT p{t.latency_percentile} s")
    if t.inter_token_latency_s is not None and figures.inter_token_latency_s is not None:
        proportional(
            figures.inter_token_latency_s,
            t.inter_token_latency_s,
            f"inter-token latency p{t.latency_percentile} s",
        )
    if not asks:
        return None
    return max(asks, key=lambda a: a[0])


def _history(
    memory: RoleMemory | None, now_s: float, rec: int | None, window_s: float
) -> tuple[tuple[float, int], ...]:
    """The change points, with `rec` added when it differs, pruned to the window (plus the
    point in force at its start)."""
    points = list(memory.history if memory is not None else ())
    if rec is not None and (not points or points[-1][1] != rec):
        points.append((now_s, rec))
    start = now_s - window_s
    inside = [i for i, (t, _) in enumerate(points) if t >= start]
    first = inside[0] if inside else len(points)
    if first > 0 and (first == len(points) or points[first][0] > start):
        first -= 1  # the point in force when the window opened
    return tuple(points[first:][-MAX_HISTORY:])


def _window_high(history: tuple[tuple[float, int], ...]) -> int:
    """The highest recommendation in force during the window (`_history` keeps just those)."""
    return max(v for _, v in history)


@dataclass(frozen=True, slots=True)
class _Wanted:
    role: WorkerRole
    current: int
    wanted: int
    rec: int | None
    message: str
    reason: Reason
    may_grow: bool
    may_shrink: bool
    memory: RoleMemory


def _want(role: WorkerRole, inp: RoleInput, now_s: float) -> _Wanted:
    """Steps 1-3 for one role."""
    current = inp.current()
    auto = inp.autoscaling
    if auto is None:
        memory = RoleMemory(current)
        fixed: Reason = "Fixed"
        return _Wanted(role, current, current, None, "fixed replicas", fixed, False, False, memory)
    got = recommend(auto, current, inp.figures)
    rec, message = (got[0], got[1]) if got is not None else (None, "no group reported figures")
    history = _history(inp.memory, now_s, rec, auto.stabilization_s)
    if rec is None:
        wanted = current
    elif rec >= current:
        wanted = rec
    else:
        wanted = min(current, _window_high(history))
    wanted = auto.clamp(wanted)
    last = inp.memory.last_scale_s if inp.memory is not None else None
    last_up = inp.memory.last_up_s if inp.memory is not None else None
    cooling = last is not None and now_s - last < auto.cooldown_s
    fresh_up = last_up is not None and now_s - last_up < auto.stabilization_s
    reason: Reason = "NoFigures" if rec is None else "Steady"
    if wanted != current and cooling:
        reason, wanted = "HeldByCooldown", current
    elif wanted < current and fresh_up:
        reason, wanted = "HeldByWindow", current
    elif rec is not None and wanted < current and wanted > rec:
        message += f"; the window's highest recommendation is {wanted}"
    base = inp.memory or RoleMemory(current)
    memory = replace(base, replicas=current, history=history)
    return _Wanted(
        role,
        current,
        wanted,
        rec,
        message,
        reason,
        may_grow=not cooling,
        may_shrink=not cooling and not fresh_up,
        memory=memory,
    )


def _within(band: RatioBand, skew: int, prefill: int, decode: int) -> bool:
    lo, hi = band.prefill_bounds(decode)
    return lo - skew <= prefill <= hi + skew


def _coordinate(
    band: RatioBand,
    wanted: Mapping[WorkerRole, _Wanted],
    bounds: Mapping[WorkerRole, tuple[int, int]],
) -> tuple[int, int]:
    """Step 4: the pair in the band nearest what the roles want, the lagging one raised."""
    (p_lo, p_hi), (d_lo, d_hi) = bounds["prefill"], bounds["decode"]
    want_p, want_d = wanted["prefill"].wanted, wanted["decode"].wanted
    decode = max(d_lo, min(d_hi, max(want_d, math.ceil(want_p / band.max_ratio - 1e-9))))
    lo, hi = band.prefill_bounds(decode)
    prefill = max(p_lo, lo, min(p_hi, hi, want_p))
    return prefill, decode


def decide(
    inputs: Mapping[WorkerRole, RoleInput], coupling: AutoscalingSpec, now_s: float
) -> dict[WorkerRole, RoleDecision]:
    """Every role's decision (steps 1-5); roles without autoscaling keep their replicas."""
    wanted = {role: _want(role, inputs[role], now_s) for role in WORKER_ROLES}
    bounds = {role: inputs[role].bounds() for role in WORKER_ROLES}
    band = coupling.ratio
    if band is None:
        pair = {role: w.wanted for role, w in wanted.items()}
        target = dict(pair)
    else:
        tp, td = _coordinate(band, wanted, bounds)
        target = {"prefill": tp, "decode": td}
        pair = _step(band, coupling.max_skew, wanted, bounds, target, inputs)
    return {role: _decision(wanted[role], pair[role], target[role], now_s) for role in WORKER_ROLES}


def _step(
    band: RatioBand,
    skew: int,
    wanted: Mapping[WorkerRole, _Wanted],
    bounds: Mapping[WorkerRole, tuple[int, int]],
    target: Mapping[WorkerRole, int],
    inputs: Mapping[WorkerRole, RoleInput],
) -> dict[WorkerRole, int]:
    """Step 5: the allowed pair nearest the target (ties: more groups, then more decode)."""
    cur_p, cur_d = wanted["prefill"].current, wanted["decode"].current
    ready_p = min(inputs["prefill"].ready, cur_p)
    ready_d = min(inputs["decode"].ready, cur_d)

    def options(role: WorkerRole, cur: int) -> range:
        lo, hi = bounds[role]
        w = wanted[role]
        fixed = inputs[role].autoscaling is None
        low = cur if fixed or not w.may_shrink else lo
        high = cur if fixed or not w.may_grow else hi
        return range(low, high + 1)

    best: tuple[tuple[int, int, int], tuple[int, int]] | None = None
    for p in options("prefill", cur_p):
        for d in options("decode", cur_d):
            if not _within(band, skew, p, d):
                continue
            if p > cur_p and not _within(band, skew, p, ready_d):
                continue  # prefill grows only as far as decode's ready groups allow
            if d > cur_d and not _within(band, skew, ready_p, d):
                continue
            key = (abs(target["prefill"] - p) + abs(target["decode"] - d), -(p + d), -d)
            if best is None or key < best[0]:
                best = (key, (p, d))
    # The current pair always qualifies when it is within the widened band; outside it (a
    # spec edit moved the band) the coordinated target is taken at once.
    chosen = best[1] if best is not None else (target["prefill"], target["decode"])
    return {"prefill": chosen[0], "decode": chosen[1]}


def _decision(w: _Wanted, replicas: int, target: int, now_s: float) -> RoleDecision:
    reason: Reason = w.reason
    message = w.message
    if w.reason == "Fixed":
        return RoleDecision(replicas, w.wanted, target, None, "Fixed", message, w.memory)
    memory = w.memory
    if replicas != w.current:
        up = replicas > w.current
        reason = "ScaledUp" if up else "ScaledDown"
        if replicas != w.wanted:
            message += f"; coordinated with the other role towards {target}"
        memory = replace(
            memory,
            replicas=replicas,
            last_scale_s=now_s,
            last_up_s=now_s if up else memory.last_up_s,
        )
    elif replicas != target and reason in ("Steady", "NoFigures"):
        reason = "HeldBySkew"
        message += f"; waiting for the other role's groups to be ready (towards {target})"
    return RoleDecision(
        replicas=replicas,
        wanted=w.wanted,
        target=target,
        recommended=w.rec,
        reason=reason,
        message=message,
        memory=memory,
        changed=replicas != w.current,
    )


def with_replicas(spec: DeploymentSpec, role: WorkerRole, replicas: int) -> DeploymentSpec:
    """`spec` with `role` running `replicas` groups (what a decision applies)."""
    changed = replace(spec.role(role), replicas=replicas)
    return replace(spec, prefill=changed) if role == "prefill" else replace(spec, decode=changed)
