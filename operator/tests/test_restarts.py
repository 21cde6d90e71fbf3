"""Restarts of broken PP groups: exponential backoff, a budget after which the group is left
failed (Degraded names it, an Event says so once), and resets; first as pure decisions, then
through reconcile against the in-memory API with a driven clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from support.clock import Clock
from support.fake_kube import conditions
from test_groups import T0, group, healthy, pod

from dsv4_common.api.spec import GroupRestartSpec
from dsv4_operator.reconcile import ReconcileResult, reconcile
from dsv4_operator.restarts import (
    RestartRecord,
    backoff_s,
    plan_restarts,
    records_from_status,
    records_to_status,
)

SPEC = GroupRestartSpec(
    budget=3, backoff_seconds=10, max_backoff_seconds=25, reset_after_seconds=60
)


def broken(name: str = "t-prefill-0") -> Any:
    return group(name, pod(name, 0), pod(name, 1, restart_count=1))


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(SPEC, n) for n in range(5)] == [0, 10, 20, 25, 25]


def test_first_restart_is_immediate_then_backs_off_then_stops_at_the_budget() -> None:
    g = broken()
    records: tuple[RestartRecord, ...] = ()
    now = T0
    restarted_at = []
    failed_at = []
    for _ in range(200):
        out = plan_restarts([g], [g], records, SPEC, now)
        if out.restart:
            restarted_at.append((now - T0).total_seconds())
        failed_at += [(now - T0).total_seconds() for _ in out.newly_failed]
        if not out.restart and g.name not in out.waiting:
            assert out.records[0].failed
        records = out.records
        now += timedelta(seconds=1)
    assert restarted_at == [0, 10, 30]  # waits 10 s, then 20 s
    assert failed_at == [31]  # broken again after the third restart: the budget is spent
    assert records == (RestartRecord(g.name, 3, T0 + timedelta(seconds=30), "new", failed=True),)


def test_records_reset_on_a_new_template_a_long_ready_spell_or_a_gone_group() -> None:
    r = RestartRecord("t-prefill-0", 2, T0, "new")
    g_ready = healthy("t-prefill-0")
    assert plan_restarts([], [g_ready], [r], SPEC, T0 + timedelta(seconds=59)).records == (r,)
    assert plan_restarts([], [g_ready], [r], SPEC, T0 + timedelta(seconds=60)).records == ()
    old = RestartRecord("t-prefill-0", 2, T0, "old")  # the spec changed since
    assert plan_restarts([], [g_ready], [old], SPEC, T0).records == ()
    assert plan_restarts([], [], [r], SPEC, T0).records == ()


def test_a_zero_budget_never_restarts() -> None:
    out = plan_restarts([broken()], [broken()], (), GroupRestartSpec(budget=0), T0)
    assert out.restart == () and out.newly_failed == ("t-prefill-0",)


@given(
    restarts=st.integers(0, 10_000),
    seconds=st.integers(0, 10**9),
    failed=st.booleans(),
    name=st.text(min_size=1, max_size=20),
)
def test_records_round_trip_through_status(
    restarts: int, seconds: int, failed: bool, name: str
) -> None:
    r = RestartRecord(name, restarts, T0 + timedelta(seconds=seconds), "h", failed)
    assert records_from_status({"groupRestarts": records_to_status([r])}) == [r]


def test_malformed_status_entries_are_dropped() -> None:
    status = {"groupRestarts": [{"group": "a"}, "x", {"group": "b", "restarts": "z"}]}
    assert records_from_status(status) == []


# --- through reconcile ---------------------------------------------------------------------------


def test_a_crash_looping_group_backs_off_and_is_left_failed_at_the_budget(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(groupRestarts={"budget": 2, "backoffSeconds": 30})
    clock = Clock(T0)

    def run() -> ReconcileResult:
        return reconcile(kube.cr, kube, probe, clock=clock)

    run()
    kube.run_controllers()
    probe.report_planned(kube)
    run()
    deletes = 0
    failed: list[str] = []
    for _ in range(12):  # the group crashes every 10 s, whenever it runs
        kube.run_controllers()
        kube.set_pod("tiny-decode-0-0", restarts=1)
        result = run()
        deletes += sum(1 for a in result.group_actions if a.group == "tiny-decode-0")
        failed += result.failed_groups
        clock.advance(10)
    assert deletes == 2  # at t=0 and t=30 (after 30 s of backoff), then the budget is spent
    assert failed == ["tiny-decode-0"]  # one Event's worth, not one per reconcile
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupFailed")
    assert "tiny-decode-0 failed" in degraded["message"] and "budget 2" in degraded["message"]
    (record,) = kube.cr["status"]["groupRestarts"]
    assert record["group"] == "tiny-decode-0" and record["restarts"] == 2 and record["failed"]
    # A spec change (a new template) gives the group a fresh budget: it is rolled and may
    # restart again.
    kube.cr["spec"]["decode"]["chunkedPrefillTokens"] = 512
    result = run()
    assert [a.reason for a in result.group_actions if a.group == "tiny-decode-0"] == ["Outdated"]
    assert "groupRestarts" not in kube.cr["status"]


def test_while_backing_off_degraded_says_how_long(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(groupRestarts={"backoffSeconds": 40, "maxBackoffSeconds": 40})
    clock = Clock(T0)
    reconcile(kube.cr, kube, probe, clock=clock)
    kube.run_controllers()
    kube.set_pod("tiny-decode-0-0", restarts=1)
    assert reconcile(kube.cr, kube, probe, clock=clock).group_actions  # the first: at once
    kube.run_controllers()
    kube.set_pod("tiny-decode-0-0", restarts=1)
    clock.advance(15)
    assert reconcile(kube.cr, kube, probe, clock=clock).group_actions == ()
    degraded = conditions(kube)["Degraded"]
    assert degraded["reason"] == "GroupRestarted"
    assert "tiny-decode-0 is broken; restart backs off 25 s more" in degraded["message"]
