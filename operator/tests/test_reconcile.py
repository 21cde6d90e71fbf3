"""One reconcile against an in-memory API: applies the plan, is idempotent, corrects drift,
prunes, writes status only on change, refuses a context that does not fit before any worker
exists, and restarts or rolls PP groups as units."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from support.expected import SERVING_CONDITIONS
from support.fake_kube import conditions

from dsv4_operator import labels as L
from dsv4_operator.config import OperatorConfig
from dsv4_operator.reconcile import ReconcileResult, reconcile

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def run(kube: Any, probe: Any) -> ReconcileResult:
    return reconcile(kube.cr, kube, probe, clock=lambda: NOW)


def serving(kube: Any, probe: Any) -> None:
    """Bring the deployment up: apply, pods start and report their planned capacity."""
    run(kube, probe)
    kube.run_controllers()
    probe.report_planned(kube)
    run(kube, probe)


def test_first_reconcile_applies_every_planned_object(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    result = run(kube, probe)
    assert {k[1] for k in result.applied} == {
        "Secret",  # the PD secret, created once
        "ServiceAccount",
        "ConfigMap",
        "NetworkPolicy",
        "Service",
        "PodDisruptionBudget",
        "StatefulSet",
        "Deployment",
    }
    assert len(result.applied) == 15 and result.status_written
    assert set(kube.of_kind("StatefulSet")) == {"tiny-prefill-0", "tiny-decode-0"}
    cond = conditions(kube)
    assert cond["PlanValid"]["status"] == "True" and cond["ContextFits"]["status"] == "True"
    assert cond["Ready"]["status"] == "False" and cond["Progressing"]["reason"] == "Starting"


def test_second_reconcile_makes_no_writes(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    serving(kube, probe)
    mark = len(kube.writes)
    result = run(kube, probe)
    assert kube.writes_since(mark) == []
    assert result.applied == () and result.pruned == () and not result.status_written


def test_ready_when_every_role_router_and_kv_transfer_are_up(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    serving(kube, probe)
    status = kube.cr["status"]
    assert {t: c["status"] for t, c in conditions(kube).items()} == SERVING_CONDITIONS
    assert status["roles"]["prefill"] == {"replicas": 1, "readyReplicas": 1, "ready": "1/1"}
    assert status["endpoint"] == "http://tiny-router.ns.svc:8000"
    assert status["maxContextTokens"] == 4096 and status["observedGeneration"] == 1
    rank1 = next(p for p in status["plan"] if (p["role"], p["ppRank"]) == ("prefill", 1))
    assert rank1["observed"]["fullTokens"] == rank1["fullTokens"]


def test_drift_is_corrected_by_reapplying_only_the_edited_object(
    cluster: tuple[Any, Any],
) -> None:
    kube, probe = cluster
    serving(kube, probe)
    sts = kube.of_kind("StatefulSet")["tiny-decode-0"]
    sts["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    kube.of_kind("Service")["tiny-router"]["metadata"]["annotations"].clear()
    mark = len(kube.writes)
    result = run(kube, probe)
    assert sorted(k[2] for k in result.applied) == ["tiny-decode-0", "tiny-router"]
    fixed = kube.of_kind("StatefulSet")["tiny-decode-0"]["spec"]["template"]["spec"]
    assert fixed["containers"][0]["image"] != "evil:latest"
    assert [w[0] for w in kube.writes_since(mark)] == ["apply", "apply"]


def test_objects_no_longer_planned_are_pruned_but_foreign_ones_are_kept(
    cluster: tuple[Any, Any],
) -> None:
    kube, probe = cluster
    kube.cr["spec"]["decode"]["replicas"] = 2
    serving(kube, probe)
    assert "tiny-decode-1" in kube.of_kind("StatefulSet")
    foreign = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "someone-elses",
            "namespace": "ns",
            "labels": L.owned_labels("tiny"),
            "ownerReferences": [{"uid": "another-owner"}],
        },
    }
    kube.apply(foreign)
    kube.cr["spec"]["decode"]["replicas"] = 1
    result = run(kube, probe)
    assert sorted((k[1], k[2]) for k in result.pruned) == [
        ("Service", "tiny-decode-1"),
        ("StatefulSet", "tiny-decode-1"),
    ]
    assert "tiny-decode-1" not in kube.of_kind("StatefulSet")
    assert "someone-elses" in kube.of_kind("ConfigMap")


def test_status_is_written_only_when_it_changes(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    serving(kube, probe)
    before = kube.writes.count(("patch_status", "tiny"))
    run(kube, probe)
    run(kube, probe)
    assert kube.writes.count(("patch_status", "tiny")) == before
    kube.set_pod("tiny-decode-0-0", ready=False)
    result = run(kube, probe)
    assert result.status_written and conditions(kube)["Ready"]["reason"] == "DecodeNotReady"
    # Unchanged conditions keep their transition time; changed ones get the new one.
    assert kube.writes.count(("patch_status", "tiny")) == before + 1


def test_context_that_does_not_fit_creates_no_worker_and_reports_the_largest_fit(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(maxContextTokens=1 << 20)
    result = run(kube, probe)
    assert result.applied == () and kube.objects == {}
    assert [w[0] for w in kube.writes] == ["patch_status"]
    fits = conditions(kube)["ContextFits"]
    assert fits["status"] == "False" and fits["reason"] == "ContextTooLong"
    assert "largest context that fits is 4096" in fits["message"]
    assert kube.cr["status"]["maxContextTokens"] == 4096
    assert conditions(kube)["Ready"]["status"] == "False"


def test_invalid_spec_is_permanent_and_applies_nothing(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster(kv={"transfer": "carrier-pigeon"})
    result = run(kube, probe)
    assert result.permanent and result.problem is not None
    assert "spec.kv.transfer" in result.problem.message
    plan_valid = conditions(kube)["PlanValid"]
    assert (plan_valid["status"], plan_valid["reason"]) == ("False", "InvalidSpec")
    assert kube.objects == {}


def test_a_podtemplate_setting_an_owned_field_is_an_invalid_spec_and_applies_nothing(
    make_cluster: Callable[..., tuple[Any, Any]],
) -> None:
    kube, probe = make_cluster()
    template = {"spec": {"containers": [{"name": "worker", "ports": [{"containerPort": 1}]}]}}
    kube.cr["spec"]["decode"]["podTemplate"] = template
    result = run(kube, probe)
    assert result.permanent and result.problem is not None and result.applied == ()
    field = "spec.decode.podTemplate.spec.containers[worker].ports"
    plan_valid = conditions(kube)["PlanValid"]
    assert (plan_valid["status"], plan_valid["reason"]) == ("False", "InvalidSpec")
    assert plan_valid["message"] == f"{field}: owned by the operator"
    assert conditions(kube)["Ready"]["reason"] == "InvalidSpec"
    assert kube.objects == {} and [w[0] for w in kube.writes] == ["patch_status"]
    # Running workers are left alone: fixing the spec is what applies again.
    del kube.cr["spec"]["decode"]["podTemplate"]
    assert run(kube, probe).applied


def test_a_failed_pod_restarts_its_whole_pp_group_only(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    serving(kube, probe)
    kube.set_pod("tiny-prefill-0-1", restarts=1)
    mark = len(kube.writes)
    result = run(kube, probe)
    assert [(a.group, a.reason) for a in result.group_actions] == [
        ("tiny-prefill-0", "PodRestarted")
    ]
    selector = L.selector_string(L.group_selector("tiny", "tiny-prefill-0"))
    assert kube.writes_since(mark) == [("delete_pods", selector), ("patch_status", "tiny")]
    pods = set(kube.of_kind("Pod"))
    assert "tiny-prefill-0-0" not in pods and "tiny-prefill-0-1" not in pods
    assert "tiny-decode-0-0" in pods
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupRestarted")
    assert kube.cr["status"]["restartingGroups"] == ["tiny-prefill-0"]
    # Later reconciles (the pods' DELETED events, the timer) keep Degraded while it re-forms.
    kube.run_controllers(ready=False)
    assert run(kube, probe).group_actions == ()
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "GroupRestarted")
    assert "tiny-prefill-0 is re-forming" in degraded["message"]
    # The group comes back healthy: Degraded clears and nothing more happens.
    kube.run_controllers()
    probe.report_planned(kube)
    assert run(kube, probe).group_actions == ()
    assert conditions(kube)["Ready"]["status"] == "True"
    assert conditions(kube)["Degraded"]["status"] == "False"
    assert "restartingGroups" not in kube.cr["status"]


def test_without_surge_a_spec_change_rolls_one_group_per_role_at_a_time(
    cluster: tuple[Any, Any],
) -> None:
    kube, probe = cluster
    kube.cr["spec"]["prefill"]["replicas"] = 2
    kube.cr["spec"]["prefill"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 1}
    serving(kube, probe)
    kube.cr["spec"]["prefill"]["chunkedPrefillTokens"] = 512
    kube.cr["metadata"]["generation"] = 2
    first = run(kube, probe)
    assert [a.group for a in first.group_actions] == ["tiny-prefill-0"]
    assert conditions(kube)["Progressing"]["reason"] == "Rolling"
    # While group 0 re-forms, group 1 (still outdated, still serving) is left alone.
    assert run(kube, probe).group_actions == ()
    kube.run_controllers()
    second = run(kube, probe)
    assert [a.group for a in second.group_actions] == ["tiny-prefill-1"]
    kube.run_controllers()
    probe.report_planned(kube)
    assert run(kube, probe).group_actions == ()
    assert conditions(kube)["Progressing"]["reason"] == "Complete"
    assert kube.cr["status"]["observedGeneration"] == 2


def test_a_one_replica_role_keeps_a_ready_group_through_a_surge_roll(
    cluster: tuple[Any, Any],
) -> None:
    kube, probe = cluster
    serving(kube, probe)
    assert conditions(kube)["Ready"]["status"] == "True"
    for role in ("prefill", "decode"):  # both templates change
        kube.cr["spec"][role]["podTemplate"] = {"metadata": {"annotations": {"rev": "2"}}}
    kube.cr["metadata"]["generation"] = 2
    seen: list[tuple[str, ...]] = []
    for _ in range(20):
        result = run(kube, probe)
        seen.append(tuple(sorted(kube.of_kind("StatefulSet"))))
        status = kube.cr["status"]
        for role in ("prefill", "decode"):
            assert status["roles"][role]["readyReplicas"] == 1, (seen, role)
        assert conditions(kube)["Ready"]["status"] == "True", seen
        if conditions(kube)["Progressing"]["reason"] == "Complete":
            break
        assert all(not a.restart for a in result.group_actions)
        kube.run_controllers()
        probe.report_planned(kube)
    else:
        raise AssertionError(f"the roll did not finish: {seen}")
    # Decode surged first, prefill followed once a new decode was ready; both surge groups are
    # gone at the end, and every pod runs the new template.
    assert seen[0] == ("tiny-decode-0", "tiny-decode-1", "tiny-prefill-0")
    assert ("tiny-decode-0", "tiny-decode-1", "tiny-prefill-0", "tiny-prefill-1") in seen
    assert seen[-1] == ("tiny-decode-0", "tiny-prefill-0")
    hashes = {
        p["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION]
        for p in kube.of_kind("Pod").values()
    }
    assert len(hashes) == 2  # one per group: prefill's and decode's, both current
    for name, sts in kube.of_kind("StatefulSet").items():
        want = sts["spec"]["template"]["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION]
        pods = [
            p
            for p in kube.of_kind("Pod").values()
            if p["metadata"]["labels"][L.GROUP_LABEL] == name
        ]
        assert pods and all(
            p["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION] == want for p in pods
        )


def test_kv_backend_mismatch_keeps_the_deployment_unready(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    run(kube, probe)
    kube.run_controllers()
    probe.report_planned(kube, backend="zmq")
    run(kube, probe)
    kv = conditions(kube)["KVTransferReady"]
    assert (kv["status"], kv["reason"]) == ("False", "BackendMismatch")
    assert conditions(kube)["Ready"]["reason"] == "KVTransferNotReady"


def test_realized_capacity_below_plan_is_degraded(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    run(kube, probe)
    kube.run_controllers()
    probe.report_planned(kube, scale=0.5)
    run(kube, probe)
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "CapacityBelowPlan")


def test_default_image_comes_from_operator_config(cluster: tuple[Any, Any]) -> None:
    kube, probe = cluster
    reconcile(kube.cr, kube, probe, config=OperatorConfig(default_image="local/worker:dev"))
    sts = kube.of_kind("StatefulSet")["tiny-decode-0"]["spec"]["template"]["spec"]
    assert sts["containers"][0]["image"] == "local/worker:dev"


def test_the_pd_secret_is_made_once_and_never_rewritten(cluster: tuple[Any, Any]) -> None:
    """The first reconcile creates `<name>-pd-secret` (64 hex digits, owned by the CR); later
    ones never change it (pods read it at start), and with the operator's memory of it they
    do not even ask."""
    kube, probe = cluster
    made: set[str] = set()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW, pd_secrets=made)
    (secret,) = kube.of_kind("Secret").values()
    value = secret["stringData"]["secret"]
    assert len(value) == 64 and int(value, 16) >= 0
    assert secret["metadata"]["ownerReferences"][0]["kind"] == L.KIND
    writes = len(kube.writes)
    result = reconcile(kube.cr, kube, probe, clock=lambda: NOW, pd_secrets=made)
    assert ("v1", "Secret", "tiny-pd-secret") not in result.applied
    assert not [w for w in kube.writes[writes:] if w[1] == "Secret"]
    run(kube, probe)  # another operator process (no memory): it asks, the Secret stays
    assert kube.of_kind("Secret")["tiny-pd-secret"]["stringData"]["secret"] == value
