"""The real operator (kopf running our handlers and start-up, `ApiKube`, `HttpWorkerProbe`)
against the loopback fake API server. The test plays the StatefulSet controller and the kubelet
(pods with the template's labels, Running and Ready on loopback IPs 127.0.0.2, ...) and the
workers (status JSON on those IPs), then checks what the operator wrote:

  create       finalizer, every child server-side applied with an owner reference, status
  serving      workers report the planned capacity and the router is ready -> Ready=True
  restart      a pod with restartCount 1 -> one deletecollection of its PP group's pods
  rejected     a context that does not fit, a model config the operator cannot read -> status
               (ContextFits / PlanValid False) and a Warning event say so; nothing is applied
  delete       the finalizer is released, the CR is gone, and so are its metric series

The fake applies the CRD's structural defaults, validates against its schema and CEL rules and
prunes unknown fields, as the API server would, so a status the CRD does not allow fails here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import SAMPLES
from support.expected import SERVING_CONDITIONS
from support.fake_apiserver import ApiError
from support.live_operator import NS, Live

from dsv4_operator import labels as L
from dsv4_operator.diff import holds
from dsv4_operator.render import render

# ---------------------------------------------------------------------------------------------
# Scenarios

CHILD_KINDS = {
    ("v1", "ServiceAccount"): {"tiny-workload"},
    ("v1", "ConfigMap"): {"tiny-config"},
    ("networking.k8s.io/v1", "NetworkPolicy"): {"tiny-workers", "tiny-router"},
    ("v1", "Service"): {
        "tiny-prefill",
        "tiny-decode",
        "tiny-prefill-0",
        "tiny-decode-0",
        "tiny-router",
    },
    ("policy/v1", "PodDisruptionBudget"): {"tiny-prefill", "tiny-decode"},
    ("apps/v1", "StatefulSet"): {"tiny-prefill-0", "tiny-decode-0"},
    ("apps/v1", "Deployment"): {"tiny-router"},
}


def _plan_valid(live: Live, name: str) -> bool:
    cond = live.condition(name, "PlanValid")
    cr = live.cr(name) or {}
    return bool(cond and cond["status"] == "True" and cr["status"].get("observedGeneration") == 1)


def test_create_applies_every_child_with_owner_references_and_writes_status(
    live: Live,
) -> None:
    cr = live.create_cr("tiny-cpu.yaml")
    uid = cr["metadata"]["uid"]
    live.wait("finalizer added", lambda: (live.cr("tiny") or {}).get("metadata", {}).get(
        "finalizers"
    ))  # fmt: skip
    live.wait("status PlanValid", lambda: _plan_valid(live, "tiny"))
    live.wait(
        "every child applied",
        lambda: all(set(live.children(k, av)) >= names for (av, k), names in CHILD_KINDS.items()),
    )
    body = live.cr("tiny")
    assert body is not None
    assert body["metadata"]["finalizers"] == [f"{L.GROUP}/finalizer"]
    assert body["status"]["observedGeneration"] == 1
    for (api_version, kind), names in CHILD_KINDS.items():
        children = live.children(kind, api_version)
        assert set(children) == names, kind
        for child in children.values():
            (owner,) = child["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"]) == (L.KIND, "tiny", uid)
            assert owner.get("controller") is True
            labels = child["metadata"]["labels"]
            assert labels[L.DEPLOYMENT_LABEL] == "tiny"
            managers = {(m["manager"], m["operation"]) for m in child["metadata"]["managedFields"]}
            assert managers == {(L.FIELD_MANAGER, "Apply")}, (kind, managers)
    # `dsv4 render` of this CR shows exactly what the operator applied (GitOps == operator).
    rendered = [d for d in yaml.safe_load_all(render(body)) if d]
    assert {(o["kind"], o["metadata"]["name"]) for o in rendered} == {
        (kind, name) for (_, kind), names in CHILD_KINDS.items() for name in names
    }
    for obj in rendered:
        applied = live.children(obj["kind"], obj["apiVersion"])[obj["metadata"]["name"]]
        assert holds(applied, obj), (obj["kind"], obj["metadata"]["name"])
    # Every child write on the wire: a forced server-side apply by our field manager.
    child_writes = [
        r
        for r in live.server.requests
        if r.method in ("POST", "PUT", "PATCH", "DELETE")
        and L.PLURAL not in r.path
        and "/events" not in r.path
        and "/secrets" not in r.path
    ]
    assert len(child_writes) == sum(len(n) for n in CHILD_KINDS.values())
    # The PD secret: created once (201), then left alone (409); never read or changed.
    secret_calls = [r for r in live.server.requests if "/secrets" in r.path]
    assert secret_calls and {r.method for r in secret_calls} == {"POST"}
    assert secret_calls[0].code == 201 and {r.code for r in secret_calls[1:]} <= {409}
    for request in child_writes:
        assert request.method == "PATCH"
        assert request.content_type == "application/apply-patch+yaml"
        assert request.query == {"fieldManager": L.FIELD_MANAGER, "force": "true"}
    # Status went to the status subresource as a merge patch.
    status_writes = live.server.requests_to("PATCH", f"/{L.PLURAL}/tiny/status")
    assert status_writes
    assert {r.content_type for r in status_writes} == {"application/merge-patch+json"}


def test_workers_at_planned_capacity_make_it_ready_and_a_restart_deletes_the_group(
    live: Live,
) -> None:
    live.create_cr("tiny-cpu.yaml")
    live.wait("StatefulSets applied", lambda: len(live.children("StatefulSet", "apps/v1")) == 2)
    live.wait("router applied", lambda: "tiny-router" in live.children("Deployment", "apps/v1"))
    pods = live.create_pods()
    assert sorted(pods) == ["tiny-decode-0-0", "tiny-prefill-0-0", "tiny-prefill-0-1"]
    live.report_planned("tiny")
    t0 = time.monotonic()
    live.start_pods(pods)

    # Pod events reconcile at once: every worker is up and reports its planned capacity.
    def workers_up() -> dict[str, Any] | None:
        status = (live.cr("tiny") or {}).get("status") or {}
        roles = status.get("roles") or {}
        up = all((roles.get(r) or {}).get("ready") == "1/1" for r in L.WORKER_ROLES)
        observed = all("observed" in p for p in status.get("plan") or [{}])
        return status if up and observed else None

    status = live.wait("workers ready and reporting", workers_up)
    live.timings["pods started -> workers ready"] = round(time.monotonic() - t0, 2)
    assert {(p["role"], p["ppRank"]) for p in status["plan"]} == {
        ("prefill", 0),
        ("prefill", 1),
        ("decode", 0),
    }
    for entry in status["plan"]:
        assert entry["observed"] == {
            "fullTokens": entry["fullTokens"],
            "swaTokens": entry["swaTokens"],
            "maxRunningRequests": entry["maxRunningRequests"],
            "maxContextTokens": entry["maxContextTokens"],
        }
    assert set(live.workers.hits) == {f"{live.ips[p]}/status" for p in pods}  # on pod IPs
    not_ready = live.condition("tiny", "Ready")
    assert not_ready is not None and not_ready["reason"] == "RouterNotReady"

    # The router's Deployment becomes ready: its event reconciles at once.
    live.settle(quiet=0.5)
    t0 = time.monotonic()
    live.server.set_status(
        "apps/v1", "Deployment", NS, "tiny-router", {"replicas": 1, "readyReplicas": 1}
    )
    ready = live.wait(
        "Ready after the router",
        lambda: (c := live.condition("tiny", "Ready")) and c["status"] == "True" and c,
    )
    live.timings["router ready -> Ready"] = round(time.monotonic() - t0, 2)
    assert ready["reason"] == "Serving"
    status = live.cr("tiny")["status"]  # type: ignore[index]
    assert status["roles"]["router"]["ready"] == "1/1"
    assert status["endpoint"] == f"http://tiny-router.{NS}.svc:8000"
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds == SERVING_CONDITIONS

    # A PP rank's container restarted: the whole group is deleted with one deletecollection.
    mark = len(live.server.requests)
    t0 = time.monotonic()
    live.set_pod("tiny-prefill-0-1", restarts=1)
    live.wait(
        "group pods deleted",
        lambda: not live.server.list("v1", "Pod", NS, f"{L.GROUP_LABEL}=tiny-prefill-0"),
    )
    live.timings["restart -> group deleted"] = round(time.monotonic() - t0, 2)
    deletes = [r for r in live.server.requests[mark:] if r.method == "DELETE"]
    selector = L.selector_string(L.group_selector("tiny", "tiny-prefill-0"))
    assert [(r.path, r.query) for r in deletes] == [
        (f"/api/v1/namespaces/{NS}/pods", {"labelSelector": selector})
    ]
    assert [p["metadata"]["name"] for p in live.server.list("v1", "Pod", NS)] == ["tiny-decode-0-0"]
    # Status says so, and keeps saying so while the group re-forms (the reconciles that the
    # pods' DELETED events trigger keep Degraded, remembering the group in restartingGroups).
    live.wait(
        "Degraded True",
        lambda: (c := live.condition("tiny", "Degraded")) and c["status"] == "True",
    )
    live.settle(quiet=0.5)  # the reconciles that the pods' deletion triggered are done
    degraded = live.condition("tiny", "Degraded")
    assert degraded is not None and (degraded["status"], degraded["reason"]) == (
        "True",
        "GroupRestarted",
    )
    assert "tiny-prefill-0" in degraded["message"]
    assert live.cr("tiny")["status"]["restartingGroups"] == ["tiny-prefill-0"]  # type: ignore[index]
    # The pod-triggered restart was posted as a Warning Event on the CR.
    events = live.wait(
        "a PodRestarted Warning event", lambda: live.events("tiny", reason="PodRestarted")
    )
    assert events[0]["type"] == "Warning" and "tiny-prefill-0" in events[0]["message"]
    ready = live.wait(
        "Ready False after the restart",
        lambda: (c := live.condition("tiny", "Ready")) and c["status"] == "False" and c,
    )
    assert ready["reason"] == "PrefillNotReady"
    # Every reconcile (create, each pod event) found the children as planned: no re-apply.
    applies = [r for r in live.server.requests if r.content_type == "application/apply-patch+yaml"]
    assert len(applies) == sum(len(names) for names in CHILD_KINDS.values())


def test_the_namespaced_operator_never_lists_or_watches_namespaces_or_crds(live: Live) -> None:
    """#23 item 5: namespaced Roles allow neither; kopf would list and watch every namespace
    (403, a warning and a fallback on a real cluster) unless told the namespaces are given."""
    live.create_cr("tiny-cpu.yaml")
    live.wait("status PlanValid", lambda: _plan_valid(live, "tiny"))
    assert [r for r in live.server.requests_to("GET") if r.path == "/api/v1/namespaces"] == []
    assert live.server.requests_to("GET", "customresourcedefinitions") == []


def test_rejected_specs_apply_no_workers_and_say_why_in_status(live: Live) -> None:
    # Valid for the CRD, but the context does not fit the memory plan.
    live.create_cr("tiny-cpu.yaml", maxContextTokens=1 << 20)
    fits = live.wait(
        "ContextFits False",
        lambda: (c := live.condition("tiny", "ContextFits")) and c["status"] == "False" and c,
    )
    assert fits["reason"] == "ContextTooLong"
    assert "largest context that fits" in fits["message"]
    assert live.cr("tiny")["status"]["maxContextTokens"] < 1 << 20  # type: ignore[index]
    # Valid for the CRD, but the model's config.json is not where the operator plans.
    assert not Path("/models/DeepSeek-V4-Pro/config.json").exists()
    live.create_cr("pro-pd-pp.yaml")
    plan = live.wait(
        "PlanValid False",
        lambda: (c := live.condition("pro", "PlanValid")) and c["status"] == "False" and c,
    )
    assert plan["reason"] == "PlanFailed" and "spec.model.configPath" in plan["message"]
    # The handler's warning became a Kubernetes Event on the CR (kopf posts WARNING and up).
    events = live.wait(
        "a Warning event about pro",
        lambda: [e for e in live.events("pro") if e["type"] == "Warning"],
    )
    assert "PlanFailed" in events[0]["message"]
    # The CRD's admission refuses what it can check itself (here: a zero context) with 422.
    bad = yaml.safe_load((SAMPLES / "invalid" / "zero-max-context.yaml").read_text())
    bad["metadata"]["namespace"] = NS
    with pytest.raises(ApiError, match=r"spec\.maxContextTokens") as refused:
        live.server.create(bad)
    assert refused.value.code == 422
    time.sleep(1.0)  # give the operator time to (wrongly) apply something
    for api_version, kind in CHILD_KINDS:
        assert live.children(kind, api_version) == {}, kind
    writes = [r for r in live.server.requests if r.method in ("PATCH", "PUT", "POST")]
    assert not [r for r in writes if r.content_type == "application/apply-patch+yaml"]


def test_served_model_names_reach_every_rank_config_and_bad_ones_are_refused(
    live: Live,
) -> None:
    names = ["tiny-chat", "tiny"]
    live.create_cr("tiny-cpu.yaml", model={"preset": "tiny", "servedModelNames": names})

    def rank_configs() -> list[dict[str, Any]]:
        config_map = live.children("ConfigMap", "v1").get("tiny-config") or {"data": {}}
        keys = [k for k in config_map["data"] if "-rank-" in k]
        return [json.loads(config_map["data"][k]) for k in keys]

    configs = live.wait("the rank configs", rank_configs)
    assert len(configs) == 3  # prefill PP 2, decode PP 1
    assert all(c["model"]["served_model_names"] == names for c in configs)
    # What a real API server refuses, the strict fake refuses: a repeated name (a list-type
    # set), whitespace in a name (the pattern), two names for SGLang (a CEL rule).
    for sample in ("served-names-duplicate", "served-name-with-space", "sglang-two-served-names"):
        bad = yaml.safe_load((SAMPLES / "invalid" / f"{sample}.yaml").read_text())
        bad["metadata"]["namespace"] = NS
        with pytest.raises(ApiError, match=r"spec\.model\.servedModelNames") as refused:
            live.server.create(bad)
        assert refused.value.code == 422


def test_deleting_the_cr_releases_the_finalizer(live: Live) -> None:
    live.create_cr("tiny-cpu.yaml")
    live.wait("status PlanValid", lambda: _plan_valid(live, "tiny"))
    planned = {"namespace": NS, "deployment": "tiny", "role": "decode", "pp_rank": "0"}
    gauge = "dsv4_operator_planned_full_tokens"
    live.wait(
        "planned capacity exported", lambda: live.metrics.registry.get_sample_value(gauge, planned)
    )
    live.server.delete(L.API_VERSION, L.KIND, NS, "tiny")
    assert (live.cr("tiny") or {}).get("metadata", {}).get("deletionTimestamp")
    live.wait("CR gone", lambda: live.cr("tiny") is None)
    live.wait(
        "metric series gone", lambda: live.metrics.registry.get_sample_value(gauge, planned) is None
    )
    # kopf added its finalizer once and released it once, with JSON patches guarded by
    # resourceVersion (the fake logs a write as done before anyone can see what it did, so the
    # release that made the CR go is in the log with its code).
    patches = [
        r.body
        for r in live.server.requests_to("PATCH", f"/{L.PLURAL}/tiny")
        if r.path.endswith(f"/{L.PLURAL}/tiny")  # not /status
        and r.content_type == "application/json-patch+json"
        and r.code == 200
    ]
    added, removed = patches
    assert added[0]["op"] == removed[0]["op"] == "test"
    assert added[0]["path"] == "/metadata/resourceVersion"
    assert added[1] == {
        "op": "add",
        "path": "/metadata/finalizers",
        "value": [f"{L.GROUP}/finalizer"],
    }
    assert removed[1]["op"] == "remove" and removed[1]["path"].startswith("/metadata/finalizers")
    # Owner references let the garbage collector remove every child (the fake collects them).
    live.wait("children collected", lambda: not live.children("StatefulSet", "apps/v1"))
