"""kopf glue: error mapping and settings, without a cluster."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf
import pytest

from dsv4_operator import labels as L
from dsv4_operator import settings
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.handlers import Deps, reconcile_owner, run_reconcile
from dsv4_operator.kube import KubeError
from dsv4_operator.settings import configure

LOG = logging.getLogger("test")


def deps(kube: Any, probe: Any, gate: ReconcileGate | None = None) -> Deps:
    """What settings.on_startup puts in kopf's memo, with a gate of this test's own."""
    return Deps(kube, probe, OperatorConfig(), gate or ReconcileGate())


class ConflictingKube:
    def __getattr__(self, name: str) -> Any:
        def fail(*_: Any, **__: Any) -> Any:
            raise KubeError("apply: 409 Conflict", retryable=True, status=409)

        return fail


def test_api_conflict_is_a_temporary_error(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    with pytest.raises(kopf.TemporaryError):
        run_reconcile(kube.cr, deps(ConflictingKube(), probe), LOG)


def test_invalid_spec_is_a_permanent_error_after_status_is_written(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(maxContextTokens=0)
    with pytest.raises(kopf.PermanentError, match=r"spec\.maxContextTokens"):
        run_reconcile(kube.cr, deps(kube, probe), LOG)
    assert kube.writes == [("patch_status", "tiny")]


def test_context_too_long_is_reported_not_raised(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(maxContextTokens=8192)
    result = run_reconcile(kube.cr, deps(kube, probe), LOG)
    assert result.problem is not None and result.problem.reason == "ContextTooLong"


@pytest.mark.parametrize(
    ("env", "standalone"), [({}, True), ({"DSV4_PEERING": "dsv4", "DSV4_PRIORITY": "5"}, False)]
)
def test_settings_from_environment(env: dict[str, str], standalone: bool) -> None:
    settings = kopf.OperatorSettings()
    configure(settings, env)
    assert settings.peering.standalone is standalone
    assert settings.persistence.finalizer == "serving.dsv4.io/finalizer"
    if not standalone:
        assert (settings.peering.name, settings.peering.priority) == ("dsv4", 5)
    assert settings.scanning.disabled is False  # cluster-wide: kopf watches namespaces, CRDs


def test_namespaced_mode_scans_no_cluster_wide_resource() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, {"DSV4_NAMESPACED": "true"})
    assert settings.scanning.disabled is True


def _ready_cluster(kube: Any, probe: Any) -> None:
    run_reconcile(kube.cr, deps(kube, probe), LOG)
    kube.run_controllers()
    probe.report_planned(kube)
    run_reconcile(kube.cr, deps(kube, probe), LOG)


def test_a_pod_event_restarts_the_broken_group_at_once(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    _ready_cluster(kube, probe)
    pod = sorted(kube.of_kind("Pod"))[0]
    group = kube.of_kind("Pod")[pod]["metadata"]["labels"][L.GROUP_LABEL]
    kube.set_pod(pod, restarts=1)
    mark = len(kube.writes)
    warnings: list[tuple[str, str, str]] = []
    result = reconcile_owner(
        "ns",
        "tiny",
        deps(kube, probe),
        LOG,
        warn=lambda body, reason, msg: warnings.append((body["metadata"]["uid"], reason, msg)),
    )
    assert result is not None and [a.group for a in result.group_actions] == [group]
    # Posted as a Warning Event on the CR (kopf's event-handler logger posts nothing).
    assert [w[:2] for w in warnings] == [("cr-uid-1", "PodRestarted")]
    assert group in warnings[0][2]
    selector = L.selector_string(L.group_selector("tiny", group))
    assert ("delete_pods", selector) in kube.writes_since(mark)


def test_a_pod_event_reads_the_current_cr(cluster: tuple[Any, Any]) -> None:
    """The pod handler reconciles the CR as the API holds it now (a spec edit included)."""
    kube, probe = cluster
    _ready_cluster(kube, probe)
    kube.cr["metadata"]["generation"] = 2
    result = reconcile_owner("ns", "tiny", deps(kube, probe), LOG)
    assert result is not None and result.status["observedGeneration"] == 2


@pytest.mark.parametrize("state", ["gone", "deleting"])
def test_a_pod_event_of_a_gone_or_deleting_cr_does_nothing(
    cluster: tuple[Any, Any], state: str
) -> None:
    kube, probe = cluster
    if state == "gone":
        kube.cr_deleted = True
    else:
        kube.cr["metadata"]["deletionTimestamp"] = "2026-11-21T00:00:00Z"
    assert reconcile_owner("ns", "tiny", deps(kube, probe), LOG) is None
    assert kube.writes == []


def test_a_pod_event_of_an_invalid_cr_leaves_the_error_in_status(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(maxContextTokens=0)
    assert reconcile_owner("ns", "tiny", deps(kube, probe), LOG) is None
    assert kube.writes == [("patch_status", "tiny")]
    assert any(
        c["type"] == "PlanValid" and c["status"] == "False" for c in kube.cr["status"]["conditions"]
    )


def test_pod_events_coalesce_while_a_reconcile_waits(cluster: tuple[Any, Any]) -> None:
    """A burst of pod events costs one reconcile per lock release, not one per event."""
    kube, probe = cluster
    gate = ReconcileGate()
    results: list[Any] = []
    with gate.lock("ns/tiny"):  # a reconcile of this deployment is running
        waiting = threading.Thread(
            target=lambda: results.append(
                reconcile_owner("ns", "tiny", deps(kube, probe, gate), LOG)
            )
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while not gate.waiting("ns/tiny") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.waiting("ns/tiny")
        for _ in range(5):  # further events are folded into the waiting reconcile
            assert reconcile_owner("ns", "tiny", deps(kube, probe, gate), LOG) is None
        assert kube.writes == []
    waiting.join(timeout=10)
    assert len(results) == 1 and results[0] is not None and results[0].applied
    assert not gate.waiting("ns/tiny")


def test_each_operator_start_has_its_own_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """No reconcile state outlives a kopf run: start-up puts a fresh gate in the memo."""
    monkeypatch.setattr(settings.ApiKube, "from_environment", lambda _timeout: object())
    memos = [kopf.Memo(), kopf.Memo()]
    for memo in memos:
        settings.on_startup(settings=kopf.OperatorSettings(), memo=memo)
    gates = [Deps.from_memo(memo).gate for memo in memos]
    assert all(isinstance(g, ReconcileGate) for g in gates) and gates[0] is not gates[1]


def test_a_change_or_timer_reconcile_reads_the_current_cr(cluster: tuple[Any, Any]) -> None:
    """kopf's body may predate the last status write: the reconcile acts on the CR as the API
    holds it now, as the pod-event path does (#23 item 2)."""
    import copy

    kube, probe = cluster
    _ready_cluster(kube, probe)
    stale = copy.deepcopy(kube.cr)
    kube.cr["metadata"]["generation"] = 2
    result = run_reconcile(stale, deps(kube, probe), LOG)
    assert result is not None and result.status["observedGeneration"] == 2


@pytest.mark.parametrize("state", ["gone", "deleting"])
def test_a_change_or_timer_reconcile_of_a_gone_or_deleting_cr_does_nothing(
    cluster: tuple[Any, Any], state: str
) -> None:
    kube, probe = cluster
    body = dict(kube.cr)
    if state == "gone":
        kube.cr_deleted = True
    else:
        kube.cr["metadata"]["deletionTimestamp"] = "2026-11-21T00:00:00Z"
    assert run_reconcile(body, deps(kube, probe), LOG) is None
    assert kube.writes == []


@pytest.mark.parametrize("path", ["change or timer", "pod event"])
def test_a_group_failure_is_one_warning_event_whichever_path_sees_it(
    make_cluster: Callable[..., tuple[Any, Any]], path: str
) -> None:
    """A budget of 0: the first crash fails the group. Either path posts it as a GroupFailed
    Warning (before, the change/timer path only logged it, which kopf posts as 'Logging')."""
    kube, probe = make_cluster(groupRestarts={"budget": 0})
    _ready_cluster(kube, probe)
    pod = sorted(kube.of_kind("Pod"))[0]
    kube.set_pod(pod, restarts=1)
    warnings: list[tuple[str, str]] = []

    def warn(_body: Any, reason: str, message: str) -> None:
        warnings.append((reason, message))

    if path == "pod event":
        reconcile_owner("ns", "tiny", deps(kube, probe), LOG, warn=warn)
    else:
        run_reconcile(kube.cr, deps(kube, probe), LOG, warn=warn)
    assert [reason for reason, _ in warnings] == ["GroupFailed"]
    run_reconcile(kube.cr, deps(kube, probe), LOG, warn=warn)  # recorded: not posted again
    reconcile_owner("ns", "tiny", deps(kube, probe), LOG, warn=warn)
    assert [reason for reason, _ in warnings] == ["GroupFailed"]
