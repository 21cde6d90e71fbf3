"""PP-group decisions: a broken group restarts as a unit; outdated groups roll with surge, never
below replicas - maxUnavailable ready groups, decode before prefill. The property test runs
whole rollouts against a simulated StatefulSet controller and kubelet."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.pods import running_pod

from dsv4_common.api.spec import DeploymentSpec, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.groups import GroupPlan, GroupState, group_states, plan_groups
from dsv4_operator.observe import PodState

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def make_spec(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> DeploymentSpec:
    body = {
        "metadata": {"name": "t"},
        "spec": {
            "model": {"preset": "tiny"},
            "maxContextTokens": 1024,
            "prefill": prefill or {},
            "decode": decode or {},
        },
    }
    return parse_spec(body)


def pod(group: str, rank: int, **kw: object) -> PodState:
    fields: dict[str, object] = {
        "role": group.split("-")[1],
        "group": group,
        "pp_rank": rank,
        "template_hash": "new",
        "created_at": T0,
        "started_at": T0 + timedelta(seconds=30),
        "ip": "10.0.0.1",
    }
    return running_pod(f"{group}-{rank}", **{**fields, **kw})


def group(name: str, *pods: PodState, pp: int = 2, surge: bool = False) -> GroupState:
    return GroupState(
        name=name,
        role="prefill" if "prefill" in name else "decode",
        replica=int(name.rsplit("-", 1)[1]),
        pp_size=pp,
        desired_hash="new",
        pods=pods,
        surge=surge,
    )


def healthy(name: str, pp: int = 2, surge: bool = False, **kw: object) -> GroupState:
    return group(name, *(pod(name, r, **kw) for r in range(pp)), pp=pp, surge=surge)


def plan(spec: DeploymentSpec, groups: Sequence[GroupState]) -> GroupPlan:
    return plan_groups(spec, groups, (), T0)


def test_healthy_groups_need_nothing() -> None:
    groups = [healthy("t-prefill-0"), healthy("t-prefill-1"), healthy("t-decode-0", pp=1)]
    assert all(g.ready and not g.outdated for g in groups)
    out = plan(make_spec({"replicas": 2, "pipelineParallel": 2}), groups)
    assert out.actions == () and out.surge == {"prefill": 0, "decode": 0}


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
    spec = make_spec({"replicas": 2, "pipelineParallel": 2})
    out = plan(spec, [broken, healthy("t-prefill-1"), healthy("t-decode-0", pp=1)])
    assert [(a.group, a.reason, a.restart) for a in out.actions] == [("t-prefill-0", reason, True)]
    assert out.surge == {"prefill": 0, "decode": 0}  # a restart is no roll: no surge


def test_terminating_pods_do_not_count_and_a_forming_group_is_not_broken() -> None:
    forming = group("t-prefill-0", pod("t-prefill-0", 0, ready=False, started_at=None))
    assert not forming.ready and forming.broken() is None
    assert plan(make_spec({"pipelineParallel": 2}), [forming]).actions == ()


def test_mixed_template_group_counts_as_outdated() -> None:
    mixed = group("t-decode-0", pod("t-decode-0", 0), pod("t-decode-0", 1, template_hash="old"))
    assert mixed.outdated


def test_one_replica_surges_before_its_only_group_goes() -> None:
    spec = make_spec(decode={"pipelineParallel": 2})
    old = healthy("t-decode-0", template_hash="old")
    prefill = healthy("t-prefill-0", pp=1)
    first = plan(spec, [prefill, old])
    assert first.actions == () and first.surge["decode"] == 1  # the surge group starts
    starting = group("t-decode-1", surge=True)
    assert plan(spec, [prefill, old, starting]).actions == ()  # not ready yet: old stays
    new = healthy("t-decode-1", surge=True)
    second = plan(spec, [prefill, old, new])
    assert [(a.group, a.reason) for a in second.actions] == [("t-decode-0", "Outdated")]
    assert second.surge["decode"] == 1  # kept until group 0 is back at the new template
    assert plan(spec, [prefill, group("t-decode-0"), new]).surge["decode"] == 1
    assert plan(spec, [prefill, healthy("t-decode-0"), new]).surge["decode"] == 0


def test_without_surge_ready_groups_roll_one_at_a_time() -> None:
    spec = make_spec(
        {"replicas": 2, "pipelineParallel": 2, "rollout": {"maxSurge": 0, "maxUnavailable": 1}}
    )
    groups = [
        healthy("t-prefill-0", template_hash="old"),
        healthy("t-prefill-1", template_hash="old"),
        healthy("t-decode-0", pp=1),
    ]
    out = plan(spec, groups)
    assert [(a.group, a.reason, a.restart) for a in out.actions] == [
        ("t-prefill-0", "Outdated", False)
    ]
    down = group("t-prefill-0", pod("t-prefill-0", 0), pod("t-prefill-0", 1, ready=False))
    assert plan(spec, [down, *groups[1:]]).actions == ()  # one down: the other waits


def test_unready_outdated_groups_roll_at_once() -> None:
    stale = group("t-prefill-0", pod("t-prefill-0", 0, template_hash="old", ready=False))
    spec = make_spec({"replicas": 2, "pipelineParallel": 2})
    groups = [stale, healthy("t-prefill-1", template_hash="old"), healthy("t-decode-0", pp=1)]
    assert [a.group for a in plan(spec, groups).actions] == ["t-prefill-0"]


def test_prefill_waits_for_a_new_decode_and_decode_keeps_its_last_old_group() -> None:
    spec = make_spec()
    old_p, old_d = (
        healthy("t-prefill-0", 1, template_hash="old"),
        healthy("t-decode-0", 1, template_hash="old"),
    )
    first = plan(spec, [old_p, old_d])
    assert first.surge == {"prefill": 0, "decode": 1}  # decode first
    new_d = healthy("t-decode-1", 1, surge=True)
    second = plan(spec, [old_p, old_d, new_d])
    # The new decode is ready: prefill starts; decode keeps the old group for the old prefill.
    assert second.surge == {"prefill": 1, "decode": 1} and second.actions == ()
    new_p = healthy("t-prefill-1", 1, surge=True)
    third = plan(spec, [old_p, new_p, old_d, new_d])
    assert [a.group for a in third.actions] == ["t-prefill-0"]
    # The old prefill is gone: now the old decode may go.
    fourth = plan(spec, [group("t-prefill-0", pp=1), new_p, old_d, new_d])
    assert [a.group for a in fourth.actions] == ["t-decode-0"]


# --- whole rollouts, simulated ------------------------------------------------------------------


@dataclasses.dataclass
class Sim:
    """The StatefulSet controller and kubelet: groups by name -> (pods' hash, ready)."""

    spec: DeploymentSpec
    pp: dict[str, int]
    live: dict[str, tuple[str, bool]]  # group -> (template hash of its pods, ready)

    def states(self, surge: dict[L.WorkerRole, int]) -> list[GroupState]:
        hashes = {
            L.group_name("t", r, i): "new"
            for r in L.WORKER_ROLES
            for i in range(self.spec.role(r).replicas + self.spec.role(r).rollout.max_surge)
        }
        pods = []
        for name, (template, ready) in self.live.items():
            role = name.split("-")[1]
            for rank in range(self.pp[role]):
                pods.append(pod(name, rank, template_hash=template, ready=ready))
        return group_states(self.spec, "t", hashes, pods, surge)

    def ready(self, role: str, template: str | None = None) -> int:
        return sum(
            1
            for n, (h, ok) in self.live.items()
            if n.split("-")[1] == role and ok and template in (None, h)
        )


def rollout_strategy() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "replicas": st.integers(1, 3),
            "surge": st.integers(0, 2),
            "unavailable": st.integers(0, 2),
        }
    ).filter(lambda r: r["surge"] + r["unavailable"] > 0)


@settings(max_examples=300, deadline=None)
@given(
    prefill=rollout_strategy(),
    decode=rollout_strategy(),
    changed=st.sampled_from(["both", "prefill", "decode"]),
    starts=st.lists(st.booleans(), max_size=60),
    prefill_first=st.booleans(),
)
def test_a_rollout_finishes_and_keeps_its_budgets(
    prefill: dict[str, Any],
    decode: dict[str, Any],
    changed: str,
    starts: list[bool],
    prefill_first: bool,
) -> None:
    def role(r: dict[str, Any]) -> dict[str, Any]:
        rollout = {"maxSurge": r["surge"], "maxUnavailable": r["unavailable"]}
        return {"replicas": r["replicas"], "rollout": rollout}

    spec = make_spec({**role(prefill), "pipelineParallel": 2}, role(decode))
    old = {"prefill": changed in ("both", "prefill"), "decode": changed in ("both", "decode")}
    sim = Sim(
        spec,
        {r: spec.role(r).pipeline_parallel for r in L.WORKER_ROLES},
        {
            L.group_name("t", r, i): ("old" if old[r] else "new", True)
            for r in L.WORKER_ROLES
            for i in range(spec.role(r).replicas)
        },
    )
    surge: dict[L.WorkerRole, int] = {"prefill": 0, "decode": 0}
    draws = iter(starts)
    for step in range(200):
        out = plan_groups(spec, sim.states(surge), (), T0)
        surge = dict(out.surge)
        # Surge groups: created (pods at the new template, not ready yet) or removed.
        for r in L.WORKER_ROLES:
            base = spec.role(r).replicas
            for i in range(base, base + spec.role(r).rollout.max_surge):
                name = L.group_name("t", r, i)
                if i < base + surge[r]:
                    sim.live.setdefault(name, ("new", False))
                else:
                    sim.live.pop(name, None)
        for action in out.actions:
            assert action.reason == "Outdated"
            sim.live[action.group] = ("new", False)  # recreated at the current template
        # Budgets: never below replicas - maxUnavailable ready groups.
        for r in L.WORKER_ROLES:
            rs = spec.role(r)
            assert sim.ready(r) >= rs.replicas - rs.rollout.max_unavailable, (step, r)
        # A compatible pair stays ready when neither role may go below its replicas: both at
        # the old templates or both at the new ones (a role that did not change pairs with any).
        if all(spec.role(r).rollout.max_unavailable == 0 for r in L.WORKER_ROLES):
            templates = ("old", "new") if changed == "both" else (None,)
            assert any(sim.ready("prefill", h) and sim.ready("decode", h) for h in templates), step
        settled = all(v == ("new", True) for v in sim.live.values())
        if not out.actions and settled and all(n == 0 for n in surge.values()):
            break
        # The kubelet: a starting group becomes ready when drawn (always, once draws run out).
        order = sorted(sim.live.items(), key=lambda kv: (("prefill" in kv[0]) != prefill_first, kv))
        for name, (template, ok) in order:
            if not ok and next(draws, True):
                sim.live[name] = (template, True)
    else:
        pytest.fail(f"the rollout did not finish: {sim.live}, surge {surge}")
    assert set(sim.live) == {
        L.group_name("t", r, i) for r in L.WORKER_ROLES for i in range(spec.role(r).replicas)
    }
