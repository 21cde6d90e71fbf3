"""PP-group decisions: restart a broken group as a unit, roll outdated groups without taking
a role below one unavailable group."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from dsv4_operator.groups import GroupState, plan_group_actions
from dsv4_operator.observe import PodState

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def pod(group: str, rank: int, **kw: object) -> PodState:
    base = PodState(
        name=f"{group}-{rank}",
        uid=f"{group}-{rank}",
        role=group.split("-")[1],
        group=group,
        pp_rank=rank,
        phase="Running",
        ready=True,
        restart_count=0,
        deleting=False,
        template_hash="new",
        created_at=T0,
        started_at=T0 + timedelta(seconds=30),
        ip="10.0.0.1",
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def group(name: str, *pods: PodState, pp: int = 2) -> GroupState:
    return GroupState(
        name=name,
        role="prefill" if "prefill" in name else "decode",
        replica=int(name.rsplit("-", 1)[1]),
        pp_size=pp,
        desired_hash="new",
        pods=pods,
    )


def healthy(name: str, **kw: object) -> GroupState:
    return group(name, pod(name, 0, **kw), pod(name, 1, **kw))


def test_healthy_groups_need_nothing() -> None:
    groups = [healthy("t-prefill-0"), healthy("t-prefill-1")]
    assert all(g.ready and not g.outdated for g in groups)
    assert plan_group_actions(groups) == []


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"restart_count": 1}, "PodRestarted"),
        ({"phase": "Failed", "ready": False}, "PodFailed"),
        ({"created_at": T0 + timedelta(minutes=5), "started_at": None}, "PodReplaced"),
    ],
)
def test_one_broken_pod_restarts_its_whole_group(bad: dict[str, object], reason: str) -> None:
    broken = group("t-prefill-0", pod("t-prefill-0", 0), pod("t-prefill-0", 1, **bad))
    actions = plan_group_actions([broken, healthy("t-prefill-1"), healthy("t-decode-0")])
    assert [(a.group, a.reason, a.restart) for a in actions] == [("t-prefill-0", reason, True)]


def test_terminating_pods_do_not_count_and_a_forming_group_is_not_broken() -> None:
    forming = group("t-prefill-0", pod("t-prefill-0", 0, ready=False, started_at=None))
    assert not forming.ready and forming.broken() is None
    assert plan_group_actions([forming]) == []


def test_ready_outdated_groups_roll_one_at_a_time_per_role() -> None:
    groups = [
        healthy("t-prefill-0", template_hash="old"),
        healthy("t-prefill-1", template_hash="old"),
        healthy("t-decode-0", template_hash="old"),
    ]
    actions = plan_group_actions(groups)
    assert [(a.group, a.reason) for a in actions] == [
        ("t-prefill-0", "Outdated"),
        ("t-decode-0", "Outdated"),
    ]
    assert not any(a.restart for a in actions)


def test_no_ready_group_rolls_while_another_group_of_the_role_is_down() -> None:
    down = group("t-prefill-0", pod("t-prefill-0", 0), pod("t-prefill-0", 1, ready=False))
    groups = [down, healthy("t-prefill-1", template_hash="old")]
    assert plan_group_actions(groups) == []


def test_unready_outdated_groups_roll_at_once() -> None:
    stale = group("t-prefill-0", pod("t-prefill-0", 0, template_hash="old", ready=False))
    groups = [stale, healthy("t-prefill-1", template_hash="old")]
    assert [a.group for a in plan_group_actions(groups)] == ["t-prefill-0"]


def test_mixed_template_group_counts_as_outdated() -> None:
    mixed = group("t-decode-0", pod("t-decode-0", 0), pod("t-decode-0", 1, template_hash="old"))
    assert mixed.outdated
