"""The supervision decisions (pure): units, backoff and budget as properties over random exit
histories and launch plans, then the event lines and the status document."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_local.plan import ProcessSpec
from dsv4_local.supervise import (
    GiveUp,
    Liveness,
    LivenessPolicy,
    Restart,
    RestartPolicy,
    Unit,
    UnitStatus,
    decide,
    describe_exit,
    exit_line,
    liveness_verdict,
    observe_liveness,
    policy_line,
    status_document,
    units_of,
)

PROPERTY = settings(max_examples=200, deadline=None)

policies = st.builds(
    RestartPolicy,
    initial_backoff_s=st.floats(0.0, 5.0),
    max_backoff_s=st.floats(5.0, 60.0),
    budget=st.integers(0, 8),
    window_s=st.floats(1.0, 1000.0),
)
# Gaps between a unit's successive exits (each after its restart, or not).
gaps = st.lists(st.floats(0.0, 300.0), min_size=1, max_size=40)


def run_exits(policy: RestartPolicy, exit_gaps: list[float]) -> list[tuple[float, object]]:
    """The decisions for a unit that exits after each gap (while it had restarted)."""
    restarts: list[float] = []
    decisions: list[tuple[float, object]] = []
    now_s = 0.0
    for gap_s in exit_gaps:
        now_s += gap_s
        decision = decide(restarts, now_s, policy)
        decisions.append((now_s, decision))
        if isinstance(decision, Restart):
            restarts.append(now_s)
            now_s += decision.delay_s
    return decisions


@PROPERTY
@given(policies, gaps)
def test_never_more_restarts_in_a_window_than_the_budget(
    policy: RestartPolicy, exit_gaps: list[float]
) -> None:
    restarts = [t for t, d in run_exits(policy, exit_gaps) if isinstance(d, Restart)]
    for t in restarts:
        assert sum(1 for u in restarts if t - policy.window_s < u <= t) <= policy.budget


@PROPERTY
@given(policies, gaps)
def test_backoff_doubles_from_the_initial_up_to_the_cap(
    policy: RestartPolicy, exit_gaps: list[float]
) -> None:
    for _, decision in run_exits(policy, exit_gaps):
        if isinstance(decision, Restart):
            k = decision.number - 1
            assert 1 <= decision.number <= policy.budget == decision.budget
            expected = min(policy.max_backoff_s, policy.initial_backoff_s * 2**k)
            assert decision.delay_s == expected <= policy.max_backoff_s
        else:
            assert isinstance(decision, GiveUp) and decision.restarts >= policy.budget


@PROPERTY
@given(policies, st.lists(st.floats(0.0, 2000.0), max_size=12), st.floats(0.0, 3000.0))
def test_only_restarts_within_the_window_count(
    policy: RestartPolicy, history: list[float], now_s: float
) -> None:
    recent = [t for t in history if now_s - t < policy.window_s]
    decision = decide(history, now_s, policy)
    if len(recent) >= policy.budget:
        assert decision == GiveUp(len(recent), policy.window_s)
    else:
        assert isinstance(decision, Restart) and decision.number == len(recent) + 1


def spec(name: str, role: str, replica: int = 0, pp_rank: int = 0) -> ProcessSpec:
    return ProcessSpec(name, role, replica, pp_rank, ("true",), {}, Path("."), "", "")


@st.composite
def plans(draw: st.DrawFn) -> list[ProcessSpec]:
    """Workers (each replica's PP ranks in order), then the router: as `build_launch_plan`."""
    specs = []
    for role in ("prefill", "decode"):
        for replica in range(draw(st.integers(1, 3))):
            pp_size = draw(st.integers(1, 4))
            for rank in range(pp_size):
                name = f"{role}-{replica}" if pp_size == 1 else f"{role}-{replica}-rank-{rank}"
                specs.append(spec(name, role, replica, rank))
    return [*specs, spec("router", "router")]


@PROPERTY
@given(plans())
def test_units_partition_the_plan_by_pp_group(processes: list[ProcessSpec]) -> None:
    units = units_of(processes)
    names = [n for u in units for n in u.members]
    assert names == [p.name for p in processes]  # each once, in start order
    by_name = {p.name: p for p in processes}
    for unit in units:
        keys = {(by_name[n].role, by_name[n].replica) for n in unit.members}
        assert len(keys) == 1
        assert [by_name[n].pp_rank for n in unit.members] == list(range(len(unit.members)))
    assert units[-1] == Unit("router", ("router",))


def test_the_defaults_are_one_second_doubling_to_30_five_in_ten_minutes() -> None:
    policy = RestartPolicy()
    delays = []
    restarts: list[float] = []
    for _ in range(6):
        decision = decide(restarts, 0.0, policy)
        if isinstance(decision, Restart):
            delays.append(decision.delay_s)
            restarts.append(0.0)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert decide(restarts, 599.0, policy) == GiveUp(5, 600.0)
    assert decide(restarts, 600.0, policy) == Restart(1.0, 1, 5)  # the window has passed
    assert RestartPolicy(budget=9).initial_backoff_s * 2**5 > 30.0  # the cap matters
    assert decide([0.0] * 6, 0.0, RestartPolicy(budget=9)) == Restart(30.0, 7, 9)
    assert policy_line(policy) == (
        "a process that exits while serving restarts with its PP group after 1 s, doubling "
        "up to 30 s, at most 5 times in 600 s"
    )


def test_event_lines() -> None:
    decode = Unit("decode-0", ("decode-0",))
    group = Unit("decode-1", ("decode-1-rank-0", "decode-1-rank-1"))
    assert exit_line(decode, "decode-0", -9, Restart(2.0, 2, 5)) == (
        "decode-0 exited with code -9 (SIGKILL); restarting in 2 s (restart 2 of 5)"
    )
    assert exit_line(group, "decode-1-rank-1", 1, Restart(0.5, 1, 5)) == (
        "decode-1-rank-1 exited with code 1; restarting its PP group decode-1 (2 processes) "
        "in 0.5 s (restart 1 of 5)"
    )
    assert exit_line(decode, "decode-0", 3, GiveUp(5, 600.0)) == (
        "decode-0 exited with code 3; giving up on it after 5 restarts in 600 s; the other "
        "processes keep serving"
    )
    assert describe_exit(-15) == "code -15 (SIGTERM)" and describe_exit(-200) == "code -200"


def test_the_status_document() -> None:
    unit = Unit("decode-0", ("decode-0",))
    doc = status_document(
        [UnitStatus(unit, "waiting", {}, 2, "decode-0 exited with code -9 (SIGKILL)", 3.96)]
    )
    assert doc == {
        "version": 1,
        "units": [
            {
                "name": "decode-0",
                "members": ["decode-0"],
                "state": "waiting",
                "pids": {},
                "restarts": 2,
                "last_exit": "decode-0 exited with code -9 (SIGKILL)",
                "restart_in_s": 4.0,
            }
        ],
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_backoff_s": 2.0, "max_backoff_s": 1.0},
        {"initial_backoff_s": -1.0},
        {"budget": -1},
        {"window_s": 0.0},
    ],
)
def test_a_bad_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_liveness_counts_non_200_answers_in_a_row_and_silence_apart() -> None:
    """Three non-200 answers in a row are an exit; a 200 between resets the count; no answer
    (a stopped or busy process) is not a failure until `silent_s` has passed."""
    policy = LivenessPolicy(period_s=1.0, failure_threshold=3, silent_s=60.0)
    seen = Liveness()
    for t, status in enumerate([503, 503, 200, 503, 503]):
        seen = observe_liveness(seen, status, float(t))
        assert liveness_verdict(seen, float(t), policy) is None
    seen = observe_liveness(seen, 503, 5.0)
    assert liveness_verdict(seen, 5.0, policy) == "its /live answered 503 3 times in a row"
    quiet = observe_liveness(Liveness(), 200, 0.0)
    for t in range(1, 60):
        quiet = observe_liveness(quiet, None, float(t))
        assert liveness_verdict(quiet, float(t), policy) is None
    quiet = observe_liveness(quiet, None, 60.0)
    assert liveness_verdict(quiet, 60.0, policy) == "its /live answered nothing for 60 s"
    assert liveness_verdict(observe_liveness(Liveness(), None, 7.0), 66.9, policy) is None
