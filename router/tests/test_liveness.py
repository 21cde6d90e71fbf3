"""The liveness rule (pure): properties over random probe histories and over a simulated
discovery loop probing a worker that is stopped (SIGSTOP) for a while, then examples."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_router.liveness import (
    Liveness,
    LivenessRule,
    ProbeOutcome,
    liveness_rule,
    observe,
    stale_reason,
)

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OUTCOMES: tuple[ProbeOutcome, ...] = ("ok", "late", "failed", "refused")

rules = st.builds(
    LivenessRule, misses=st.integers(1, 6), grace_s=st.floats(0.0, 30.0, allow_nan=False)
)
# (seconds since the previous probe, its outcome)
histories = st.lists(
    st.tuples(st.floats(0.0, 5.0, allow_nan=False), st.sampled_from(OUTCOMES)), max_size=30
)


def fold(history: list[tuple[float, ProbeOutcome]]) -> tuple[Liveness, float]:
    state, now_s = Liveness(), 0.0
    for gap_s, outcome in history:
        now_s += gap_s
        state = observe(state, outcome, now_s)
    return state, now_s


@PROPERTY
@given(histories)
def test_the_state_is_the_last_ok_and_the_misses_since(
    history: list[tuple[float, ProbeOutcome]],
) -> None:
    state, _ = fold(history)
    times, now_s = [], 0.0
    for gap_s, _outcome in history:
        now_s += gap_s
        times.append(now_s)
    oks = [i for i, (_, outcome) in enumerate(history) if outcome == "ok"]
    assert state.ok_at_s == (times[oks[-1]] if oks else None)
    assert state.misses == len(history) - 1 - oks[-1] if oks else state.misses == len(history)
    assert state.refused == (bool(history) and history[-1][1] == "refused")


@PROPERTY
@given(histories, rules, st.floats(0.0, 60.0, allow_nan=False))
def test_stale_exactly_when_the_rule_says(
    history: list[tuple[float, ProbeOutcome]], rule: LivenessRule, later_s: float
) -> None:
    state, last_s = fold(history)
    now_s = last_s + later_s
    reason = stale_reason(state, now_s, rule)
    if state.ok_at_s is None or state.refused:
        assert reason is not None
        return
    silent_s = now_s - state.ok_at_s
    assert (reason is not None) == (state.misses >= rule.misses and silent_s >= rule.grace_s)


@PROPERTY
@given(histories, rules, st.floats(0.0, 60.0, allow_nan=False), st.floats(0.0, 60.0))
def test_staleness_only_grows_with_time_and_misses(
    history: list[tuple[float, ProbeOutcome]], rule: LivenessRule, at_s: float, more_s: float
) -> None:
    state, last_s = fold(history)
    if stale_reason(state, last_s + at_s, rule) is None:
        return
    assert stale_reason(state, last_s + at_s + more_s, rule) is not None
    missed = Liveness(state.ok_at_s, state.misses + 1, state.refused)
    assert stale_reason(missed, last_s + at_s, rule) is not None


# ---- a simulated discovery loop against a worker stopped over [stop_s, resume_s) -----------


@dataclass(frozen=True)
class Loop:
    poll_interval_s: float
    timeout_s: float
    rule: LivenessRule

    @property
    def round_s(self) -> float:
        """The longest a round takes (a probe to a stopped worker waits out its timeout)."""
        return max(self.poll_interval_s, self.timeout_s)


def completions(
    loop: Loop, stop_s: float, resume_s: float, end_s: float
) -> Iterator[tuple[float, ProbeOutcome]]:
    """Each probe's completion time and outcome. A probe sent while the worker runs is answered
    at once; one sent while it is stopped is answered when it resumes if that comes before
    the timeout, else it times out. The next round starts a poll interval after the last one
    began, or when its probe completed if that is later."""
    start_s = 0.0
    while start_s < end_s:
        if not stop_s <= start_s < resume_s:
            done_s, outcome = start_s, "ok"
        elif resume_s <= start_s + loop.timeout_s:
            done_s, outcome = resume_s, "ok"
        else:
            done_s, outcome = start_s + loop.timeout_s, "late"
        yield done_s, outcome
        start_s = max(start_s + loop.poll_interval_s, done_s)


def stale_times(loop: Loop, stop_s: float, resume_s: float, end_s: float) -> list[float]:
    """Every time in [0, end_s] at which the router would judge the worker stale: staleness
    only grows between completions, so the instants just before each completion (and the
    end) are the ones to check."""
    state, stale = Liveness(), []
    for done_s, outcome in completions(loop, stop_s, resume_s, end_s):
        if stale_reason(state, done_s, loop.rule) is not None and state.ok_at_s is not None:
            stale.append(done_s)
        state = observe(state, outcome, done_s)
    if stale_reason(state, end_s, loop.rule) is not None:
        stale.append(end_s)
    return stale


@st.composite
def loops(draw: st.DrawFn) -> Loop:
    poll_interval_s = draw(st.floats(0.05, 2.0))
    rule = liveness_rule(
        poll_interval_s=poll_interval_s,
        min_grace_s=draw(st.floats(0.0, 10.0)),
        misses=draw(st.integers(1, 5)),
        grace_polls=draw(st.floats(1.0, 20.0)),
    )
    return Loop(poll_interval_s, draw(st.floats(0.05, 3.0)), rule)


@PROPERTY
@given(loops(), st.floats(1.0, 50.0), st.floats(0.0, 1.0))
def test_a_stop_shorter_than_the_grace_is_never_stale(
    loop: Loop, stop_s: float, fraction: float
) -> None:
    """Stopped for d with d + a poll interval + a round < grace: the silence never reaches
    the grace, so no request is refused for staleness (the issue's spurious 503s)."""
    room_s = loop.rule.grace_s - loop.poll_interval_s - loop.round_s
    if room_s <= 0:
        return
    resume_s = stop_s + fraction * room_s * 0.999
    assert stale_times(loop, stop_s, resume_s, resume_s + 10 * loop.round_s) == []


@PROPERTY
@given(loops(), st.floats(1.0, 50.0))
def test_a_worker_stopped_for_good_turns_stale_in_bounded_time(loop: Loop, stop_s: float) -> None:
    """Never before the grace after its last status; always by the grace plus the misses'
    rounds."""
    deadline_s = stop_s + loop.rule.grace_s + (loop.rule.misses + 1) * loop.round_s
    stale = stale_times(loop, stop_s, float("inf"), deadline_s)
    assert stale and stale[-1] == deadline_s
    assert stale[0] >= stop_s - loop.poll_interval_s + loop.rule.grace_s


# ---- examples ---------------------------------------------------------------------------------


def test_the_grace_scales_with_the_probe_interval() -> None:
    fast = liveness_rule(poll_interval_s=0.5, min_grace_s=3.0, misses=3, grace_polls=8)
    slow = liveness_rule(poll_interval_s=2.0, min_grace_s=3.0, misses=3, grace_polls=8)
    assert (fast.grace_s, slow.grace_s) == (4.0, 16.0)


def test_reasons() -> None:
    rule = LivenessRule(misses=2, grace_s=1.0)
    assert stale_reason(Liveness(), 0.0, rule) == "no status yet"
    assert stale_reason(Liveness(5.0, 1, refused=True), 5.0, rule) == (
        "nothing listens on its status port"
    )
    assert stale_reason(Liveness(5.0, 2), 6.5, rule) == (
        "2 probes in a row failed, no status for 1.5 s"
    )
    assert stale_reason(Liveness(5.0, 1), 60.0, rule) is None  # one miss is never enough


@pytest.mark.parametrize(("misses", "grace_s"), [(0, 1.0), (1, -1.0), (1, float("nan"))])
def test_a_bad_rule_is_refused(misses: int, grace_s: float) -> None:
    with pytest.raises(ValueError):
        LivenessRule(misses=misses, grace_s=grace_s)
