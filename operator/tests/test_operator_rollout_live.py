"""Safe restarts and rollouts with the real operator (kopf, `ApiKube`, `HttpWorkerProbe`) against
the loopback fake API server; the test plays the StatefulSet controller, the kubelet and the
workers (support/live_operator.py).

  backoff   a crash-looping PP group is restarted at once, then only after its backoff (the
            operator's clock is driven by the test), and is left failed at the budget: Degraded
            names it, a GroupFailed Warning Event says so, and no further restart happens
  roll      with one replica per role, a spec change rolls both roles with surge: every status
            the operator wrote through the roll says one ready group per role and Ready True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes
import pytest
from support.clock import Clock
from support.live_operator import NS, Live

from dsv4_operator import handlers
from dsv4_operator import labels as L


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The operator's clock for restart backoff (kopf's own timers keep real time); patched
    before the `live` operator starts (autouse fixtures come first)."""
    fake = Clock()
    monkeypatch.setattr(handlers, "utc_clock", fake)
    return fake


def _serving(live: Live) -> None:
    live.wait("StatefulSets applied", lambda: len(live.children("StatefulSet", "apps/v1")) == 2)
    live.wait("router applied", lambda: "tiny-router" in live.children("Deployment", "apps/v1"))
    pods = live.create_pods()
    live.report_planned("tiny")
    live.start_pods(pods)
    live.server.set_status(
        "apps/v1", "Deployment", NS, "tiny-router", {"replicas": 1, "readyReplicas": 1}
    )
    live.wait("Ready", lambda: (c := live.condition("tiny", "Ready")) and c["status"] == "True")


def _group_deletes(live: Live, group: str, since: int = 0) -> int:
    selector = L.selector_string(L.group_selector("tiny", group))
    return sum(
        1
        for r in live.server.requests[since:]
        if r.method == "DELETE"
        and r.path == f"/api/v1/namespaces/{NS}/pods"
        and r.query.get("labelSelector") == selector
    )


def _degraded(live: Live, reason: str, text: str) -> dict[str, Any] | None:
    c = live.condition("tiny", "Degraded")
    return c if c and c["reason"] == reason and text in c["message"] else None


def _reform(live: Live, group: str) -> None:
    """The StatefulSet controller recreates the deleted pods; they start."""
    live.wait(
        f"{group} pods gone",
        lambda: not live.server.list("v1", "Pod", NS, f"{L.GROUP_LABEL}={group}"),
    )
    created = live.create_pods()
    live.report_planned("tiny")
    live.start_pods(created)


def test_a_crash_looping_group_backs_off_and_stops_at_the_budget(live: Live, clock: Clock) -> None:
    live.create_cr(
        "tiny-cpu.yaml",
        groupRestarts={"budget": 2, "backoffSeconds": 60, "maxBackoffSeconds": 60},
    )
    _serving(live)
    group = "tiny-decode-0"

    # Crash 1: restarted at once.
    live.set_pod("tiny-decode-0-0", restarts=1)
    live.wait("restart 1", lambda: _group_deletes(live, group) == 1)
    _reform(live, group)

    # Crash 2, 10 s later: inside the 60 s backoff, so nothing happens; Degraded says so.
    clock.advance(10)
    live.set_pod("tiny-decode-0-0", restarts=1)
    live.wait("backing off", lambda: _degraded(live, "GroupRestarted", "backs off"))
    live.settle(quiet=0.5)
    assert _group_deletes(live, group) == 1
    # The backoff runs out; the next reconcile (here: a pod event) restarts it.
    clock.advance(60)
    live.set_pod("tiny-decode-0-0", restarts=2)
    live.wait("restart 2", lambda: _group_deletes(live, group) == 2)
    record = live.wait(
        "restart 2 recorded",
        lambda: [
            r
            for r in (live.cr("tiny") or {}).get("status", {}).get("groupRestarts") or []
            if r["group"] == group and r["restarts"] == 2
        ],
    )
    assert not record[0]["failed"]
    _reform(live, group)

    # Crash 3: the budget (2) is spent. The group is left failed, once and for all. (The clock
    # stays inside resetAfterSeconds: a timer reconcile seeing the healthy group would reset it.)
    clock.advance(30)
    mark = len(live.server.requests)
    live.set_pod("tiny-decode-0-0", restarts=1)
    degraded = live.wait("GroupFailed", lambda: _degraded(live, "GroupFailed", group))
    assert degraded["status"] == "True" and "budget 2" in degraded["message"]
    events = live.wait(
        "a GroupFailed Warning event", lambda: live.events("tiny", reason="GroupFailed")
    )
    assert events[0]["type"] == "Warning" and group in events[0]["message"]
    clock.advance(3600)
    live.set_pod("tiny-decode-0-0", restarts=5)  # more events, more reconciles
    live.settle(quiet=0.5)
    assert _group_deletes(live, group, since=mark) == 0
    assert len(live.events("tiny", reason="GroupFailed")) == 1
    (record,) = live.cr("tiny")["status"]["groupRestarts"]  # type: ignore[index]
    assert record["failed"] and record["restarts"] == 2


def _patch_spec(tmp_path: Path, spec: dict[str, Any]) -> None:
    """A spec edit as a user makes it (kubectl patch --type merge)."""
    client = kubernetes.config.new_client_from_config(config_file=str(tmp_path / "kubeconfig"))
    with client:
        kubernetes.client.CustomObjectsApi(client).patch_namespaced_custom_object(
            L.GROUP, L.VERSION, NS, L.PLURAL, "tiny", {"spec": spec}
        )


def test_a_one_replica_role_keeps_a_ready_group_throughout_a_roll(
    live: Live, tmp_path: Path
) -> None:
    live.create_cr("tiny-cpu.yaml")
    _serving(live)
    mark = len(live.server.requests)
    template = {"metadata": {"annotations": {"example.com/revision": "2"}}}
    _patch_spec(
        tmp_path, {"prefill": {"podTemplate": template}, "decode": {"podTemplate": template}}
    )

    statefulsets: list[tuple[str, ...]] = []

    def seen() -> tuple[str, ...]:
        names = tuple(sorted(live.children("StatefulSet", "apps/v1")))
        if not statefulsets or statefulsets[-1] != names:
            statefulsets.append(names)
        return names

    def done() -> bool:
        status = (live.cr("tiny") or {}).get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        complete = conds.get("Progressing", {}).get("reason") == "Complete"
        return status.get("observedGeneration") == 2 and complete and len(seen()) == 2

    def missing_pods() -> bool:
        """A StatefulSet (a surge group, a group the roll deleted) lacks pods."""
        seen()
        pods = {p["metadata"]["name"] for p in live.server.list("v1", "Pod", NS)}
        return any(
            f"{name}-{i}" not in pods
            for name, sts in live.children("StatefulSet", "apps/v1").items()
            for i in range(sts["spec"]["replicas"])
        )

    for _ in range(12):  # each round: the operator acts, then the controllers answer
        live.wait("the roll's next step", lambda: done() or missing_pods())
        if done():
            break
        created = live.create_pods()
        live.report_planned("tiny")
        live.start_pods(created)
    else:
        raise AssertionError(f"the roll did not finish: {statefulsets}")

    # Decode surged first, prefill once the new decode was ready; both surge groups went once
    # the regular groups were back at the new template.
    steady = ("tiny-decode-0", "tiny-prefill-0")
    if statefulsets[0] == steady:
        statefulsets.pop(0)
    assert statefulsets[0] == ("tiny-decode-0", "tiny-decode-1", "tiny-prefill-0")
    assert ("tiny-decode-0", "tiny-decode-1", "tiny-prefill-0", "tiny-prefill-1") in statefulsets
    assert statefulsets[-1] == steady
    # Every status the operator wrote during the roll: one ready group per role, Ready True.
    patches = [
        r.body["status"]
        for r in live.server.requests[mark:]
        if r.method == "PATCH" and r.path.endswith(f"/{L.PLURAL}/tiny/status")
    ]
    assert patches
    for patch in patches:
        for role in L.WORKER_ROLES:
            if "roles" in patch:
                assert patch["roles"][role]["readyReplicas"] == 1, patch["roles"]
        for cond in patch.get("conditions") or []:
            if cond["type"] == "Ready":
                assert cond["status"] == "True", cond
    # Every group was rolled once (its pods deleted once), none restarted.
    for group in ("tiny-prefill-0", "tiny-decode-0"):
        assert _group_deletes(live, group, since=mark) == 1
    hashes = {
        p["metadata"]["name"]: p["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION]
        for p in live.server.list("v1", "Pod", NS)
    }
    for name, sts in live.children("StatefulSet", "apps/v1").items():
        want = sts["spec"]["template"]["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION]
        assert {h for p, h in hashes.items() if p.startswith(f"{name}-")} == {want}
