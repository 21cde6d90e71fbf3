"""The autoscaling decision (`dsv4_common.api.scaling`): a table of figure series -> replica
decisions, and properties over any series (hypothesis): counts stay in range, the widened
ratio band holds at every step, no role flaps within its window or cooldown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_common.api.autoscaling_spec import (
    AutoscalingSpec,
    RatioBand,
    RoleAutoscaling,
    ScalingTargets,
)
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.scaling import (
    RoleDecision,
    RoleFigures,
    RoleInput,
    RoleMemory,
    decide,
    recommend,
)

QUEUE = ScalingTargets(queue_depth_per_replica=4)
KV = ScalingTargets(kv_utilization=0.8)


def auto(
    lo: int = 1,
    hi: int = 8,
    targets: ScalingTargets = QUEUE,
    window_s: int = 60,
    cooldown_s: int = 30,
) -> RoleAutoscaling:
    return RoleAutoscaling(lo, hi, targets, stabilization_s=window_s, cooldown_s=cooldown_s)


@dataclass
class Sim:
    """Runs the decision over a series, with every group ready once it exists (or never)."""

    prefill: RoleAutoscaling | None
    decode: RoleAutoscaling | None
    coupling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    replicas: Mapping[WorkerRole, int] | None = None
    ready_lag: bool = False  # groups become ready one decision after they are added

    def run(
        self, series: Sequence[tuple[float, Mapping[WorkerRole, RoleFigures | None]]]
    ) -> list[dict[WorkerRole, RoleDecision]]:
        memory: dict[WorkerRole, RoleMemory | None] = {r: None for r in WORKER_ROLES}
        start = self.replicas or {"prefill": 1, "decode": 1}
        ready = dict(start)
        decided = dict(start)
        out = []
        for now_s, figures in series:
            inputs = {
                role: RoleInput(
                    replicas=start[role],
                    autoscaling=self.prefill if role == "prefill" else self.decode,
                    memory=memory[role],
                    figures=figures.get(role),
                    ready=ready[role],
                )
                for role in WORKER_ROLES
            }
            decisions = decide(inputs, self.coupling, now_s)
            for role, d in decisions.items():
                memory[role] = d.memory
                # Lagging: a group added now is ready at the decision after next.
                ready[role] = min(decided[role], d.replicas) if self.ready_lag else d.replicas
                decided[role] = d.replicas
            out.append(decisions)
        return out


def queue(depth: int, groups: int = 1) -> RoleFigures:
    return RoleFigures(groups=groups, queue_depth=depth)


def kv(used: float, groups: int = 1, pool: str = "req_slots") -> RoleFigures:
    return RoleFigures(groups=groups, kv_utilization=used, binding_pool=pool)


# ---- the table ----------------------------------------------------------------------------

# (name, decode targets, figures per step every 10 s, decode replicas decided at each step)
TABLE: list[tuple[str, ScalingTargets, list[RoleFigures | None], list[int]]] = [
    (
        "queue grows: up at once, again after the cooldown (30 s)",
        QUEUE,
        [queue(2), queue(12), *[queue(20)] * 3],
        [1, 3, 3, 3, 5],
    ),
    ("within tolerance: steady", QUEUE, [queue(4), queue(4), queue(4)], [1, 1, 1]),
    (
        "a spike then quiet: down only after the window (60 s) and the cooldown",
        QUEUE,
        [queue(16), *[queue(0)] * 8],
        [4, 4, 4, 4, 4, 4, 4, 1, 1],
    ),
    (
        "flapping input: the replicas do not flap",
        QUEUE,
        [queue(12), queue(0), queue(12), queue(0), queue(12), queue(0), queue(12)],
        [3, 3, 3, 3, 3, 3, 3],
    ),
    (
        "binding pool at 0.96 of a 0.8 target: 2 groups",
        KV,
        [kv(0.96), kv(0.96, groups=2)],
        [2, 2],
    ),
    ("no figures: hold", QUEUE, [None, None], [1, 1]),
    ("capped at maxReplicas", QUEUE, [queue(400)], [8]),
]


@pytest.mark.parametrize(
    ("name", "targets", "figures", "expected"), TABLE, ids=[t[0] for t in TABLE]
)
def test_decode_series_decides_these_replicas(
    name: str, targets: ScalingTargets, figures: list[RoleFigures | None], expected: list[int]
) -> None:
    sim = Sim(prefill=None, decode=auto(targets=targets))
    got = sim.run([(10.0 * i, {"decode": f}) for i, f in enumerate(figures)])
    assert [d["decode"].replicas for d in got] == expected


def test_scale_up_names_the_figure_and_pool() -> None:
    sim = Sim(prefill=None, decode=auto(targets=KV))
    (step,) = sim.run([(0.0, {"decode": kv(0.96, pool="swa")})])
    d = step["decode"]
    assert (d.reason, d.replicas, d.recommended) == ("ScaledUp", 2, 2)
    assert "swa pool binds" in d.message and "0.96" in d.message


def test_the_ratio_band_raises_the_lagging_role_in_skew_steps() -> None:
    """Decode asks for 6; prefill:decode must stay in [0.5, 1]: prefill follows, one group
    past the other's ready groups at a time (maxSkew 1)."""
    coupling = AutoscalingSpec(ratio=RatioBand(0.5, 1.0), max_skew=1)
    sim = Sim(prefill=auto(cooldown_s=0), decode=auto(cooldown_s=0), coupling=coupling)
    got = sim.run([(float(i), {"decode": queue(24), "prefill": queue(0)}) for i in range(8)])
    pairs = [(d["prefill"].replicas, d["decode"].replicas) for d in got]
    assert pairs[-1] == (3, 6)
    for p, d in pairs:
        lo, hi = coupling.ratio.prefill_bounds(d)  # type: ignore[union-attr]
        assert lo - 1 <= p <= hi + 1
    # Decode grows only as far as prefill's one ready group allows with the skew: 1 prefill
    # is within [0.5, 1] x 4 widened by one group; prefill follows to 2.
    assert pairs[0] == (2, 4)
    assert pairs[1] == (3, 6)


def test_a_fixed_role_bounds_the_other_through_the_band() -> None:
    coupling = AutoscalingSpec(ratio=RatioBand(1.0, 2.0), max_skew=0)
    sim = Sim(
        prefill=None, decode=auto(hi=8), coupling=coupling, replicas={"prefill": 2, "decode": 1}
    )
    got = sim.run([(0.0, {"decode": queue(40)})])
    assert got[0]["decode"].replicas == 2  # prefill 2 allows decode 1..2


def test_recommend_takes_the_target_that_asks_for_most() -> None:
    targets = ScalingTargets(queue_depth_per_replica=4, kv_utilization=0.5)
    got = recommend(
        auto(targets=targets), 2, RoleFigures(groups=2, queue_depth=4, kv_utilization=1.0)
    )
    assert got is not None and got[0] == 4 and "KV utilisation" in got[1]


# ---- properties -----------------------------------------------------------------------------

figures_st = st.one_of(
    st.none(),
    st.builds(
        RoleFigures,
        groups=st.integers(1, 8),
        queue_depth=st.integers(0, 200),
        kv_utilization=st.one_of(st.none(), st.floats(0.0, 1.0)),
    ),
)
role_auto_st = st.builds(
    lambda lo, extra, window, cooldown, targets: RoleAutoscaling(
        lo, lo + extra, targets, stabilization_s=window, cooldown_s=cooldown
    ),
    st.integers(1, 4),
    st.integers(0, 6),
    st.sampled_from([0, 20, 60]),
    st.sampled_from([0, 10, 30]),
    st.sampled_from([QUEUE, KV, ScalingTargets(queue_depth_per_replica=2, kv_utilization=0.7)]),
)


@st.composite
def scenario(
    draw: st.DrawFn,
) -> tuple[Sim, list[tuple[float, dict[WorkerRole, RoleFigures | None]]]]:
    prefill = draw(st.one_of(st.none(), role_auto_st))
    decode = draw(role_auto_st)
    start = {
        "prefill": prefill.min_replicas if prefill else draw(st.integers(1, 4)),
        "decode": decode.min_replicas,
    }
    ratio = None
    if draw(st.booleans()):
        lo = draw(st.sampled_from([0.25, 0.5, 1.0]))
        ratio = RatioBand(lo, lo * draw(st.sampled_from([1.0, 2.0, 4.0])))
        p_rng = (prefill.min_replicas, prefill.max_replicas) if prefill else (start["prefill"],) * 2
        for d in range(decode.min_replicas, decode.max_replicas + 1):
            blo, bhi = ratio.prefill_bounds(d)
            if max(blo, p_rng[0]) > min(bhi, p_rng[1]):
                ratio = None  # the parser refuses such a band
                break
    skew = draw(st.integers(0, 2))
    if ratio is not None:
        # Start within the band (the parser's feasibility guarantees a pair).
        blo, bhi = ratio.prefill_bounds(start["decode"])
        p_lo, p_hi = (
            (prefill.min_replicas, prefill.max_replicas) if prefill else (start["prefill"],) * 2
        )
        start["prefill"] = max(blo, p_lo, min(bhi, p_hi, start["prefill"]))
    times = draw(st.lists(st.floats(0.5, 40.0), min_size=1, max_size=25))
    series = []
    now = 0.0
    for gap in times:
        now += gap
        series.append((now, {"prefill": draw(figures_st), "decode": draw(figures_st)}))
    sim = Sim(
        prefill,
        decode,
        AutoscalingSpec(ratio=ratio, max_skew=skew),
        replicas=start,
        ready_lag=draw(st.booleans()),
    )
    return sim, series


@settings(max_examples=300, deadline=None)
@given(scenario())
def test_any_series_keeps_range_band_and_never_flaps(
    case: tuple[Sim, list[tuple[float, dict[WorkerRole, RoleFigures | None]]]],
) -> None:
    sim, series = case
    got = sim.run(series)
    band, skew = sim.coupling.ratio, sim.coupling.max_skew
    last_change: dict[WorkerRole, float] = {}
    last_up: dict[WorkerRole, float] = {}
    previous = dict(sim.replicas or {})
    for (now_s, _), step in zip(series, got, strict=True):
        for role in WORKER_ROLES:
            a = sim.prefill if role == "prefill" else sim.decode
            n = step[role].replicas
            if a is None:
                assert n == previous[role], "a role without autoscaling never changes"
                continue
            assert a.min_replicas <= n <= a.max_replicas
            if n != previous[role]:
                if role in last_change:
                    assert now_s - last_change[role] >= a.cooldown_s, "changed within cooldown"
                if n < previous[role] and role in last_up:
                    assert now_s - last_up[role] >= a.stabilization_s, "down within the window"
                last_change[role] = now_s
                if n > previous[role]:
                    last_up[role] = now_s
        if band is not None:
            lo, hi = band.prefill_bounds(step["decode"].replicas)
            assert lo - skew <= step["prefill"].replicas <= hi + skew
        previous = {r: step[r].replicas for r in WORKER_ROLES}


@settings(max_examples=200, deadline=None)
@given(role_auto_st, st.integers(0, 200), st.floats(0.0, 1.0), st.integers(1, 8))
def test_steady_figures_settle(a: RoleAutoscaling, depth: int, used: float, groups: int) -> None:
    """The same figures over and over: the replicas stop moving (no oscillation), and the
    last decision is Steady or held at a bound."""
    sim = Sim(prefill=None, decode=a)
    fig = RoleFigures(groups=groups, queue_depth=depth, kv_utilization=used)
    got = sim.run([(i * 61.0, {"decode": fig}) for i in range(12)])
    tail = [d["decode"].replicas for d in got[-4:]]
    assert len(set(tail)) == 1
