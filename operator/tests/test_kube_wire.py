"""`ApiKube` (the official client's DynamicClient) against a loopback fake API server: what goes
on the wire for each verb, and how failures map to `KubeError(retryable=...)`."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from repo_paths import CRD_FILE, SAMPLES
from support.fake_apiserver import FakeApiServer, load_crd

from dsv4_operator import labels as L
from dsv4_operator.kube_api import UNSERVED_RECHECK_S, ApiKube, KubeError

NS = "default"
CR_PATH = f"/apis/{L.GROUP}/{L.VERSION}/namespaces/{NS}/{L.PLURAL}"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    # The DynamicClient caches discovery in tempfile.gettempdir(): keep it per test.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    crd = load_crd(CRD_FILE)
    with FakeApiServer([crd], namespaces=[NS, "other"]) as srv:
        yield srv


@pytest.fixture
def kube(server: FakeApiServer) -> Iterator[ApiKube]:
    config = kubernetes.client.Configuration()
    config.host = server.url
    with kubernetes.client.ApiClient(config) as api_client:
        yield ApiKube(api_client, request_timeout_s=5.0)


def config_map(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
        "data": data,
    }


def pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "worker", "image": "w"}]},
    }


def writes(server: FakeApiServer) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in server.requests if r.method != "GET"]


def test_apply_is_a_forced_server_side_apply_that_creates_then_updates(
    server: FakeApiServer, kube: ApiKube
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "tiny-router", "namespace": NS, "labels": {"a": "1"}},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "r"}]}}},
    }
    kube.apply(deployment)
    created = server.get("apps/v1", "Deployment", NS, "tiny-router")
    assert created is not None and created["spec"]["replicas"] == 1
    kube.apply({**deployment, "spec": {**deployment["spec"], "replicas": 3}})
    updated = server.get("apps/v1", "Deployment", NS, "tiny-router")
    assert updated is not None and updated["spec"]["replicas"] == 3
    assert updated["metadata"]["uid"] == created["metadata"]["uid"]
    assert int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/tiny-router"
    assert writes(server) == [("PATCH", path), ("PATCH", path)]
    for request in server.requests_to("PATCH"):
        assert request.content_type == "application/apply-patch+yaml"
        assert request.query == {"fieldManager": L.FIELD_MANAGER, "force": "true"}
        assert request.body["metadata"]["name"] == "tiny-router"
    assert server.requests_to("PATCH")[1].body["spec"]["replicas"] == 3
    managers = {(m["manager"], m["operation"]) for m in updated["metadata"]["managedFields"]}
    assert managers == {(L.FIELD_MANAGER, "Apply")}


def test_get_returns_the_object_or_none_when_missing(server: FakeApiServer, kube: ApiKube) -> None:
    server.create(config_map("present", x="1"))
    got = kube.get("v1", "ConfigMap", NS, "present")
    assert got is not None and got["data"] == {"x": "1"} and got["kind"] == "ConfigMap"
    assert kube.get("v1", "ConfigMap", NS, "absent") is None
    assert [r.path for r in server.requests_to("GET", "/configmaps/")] == [
        f"/api/v1/namespaces/{NS}/configmaps/present",
        f"/api/v1/namespaces/{NS}/configmaps/absent",
    ]


def test_list_sends_the_label_selector_and_returns_only_matching_objects(
    server: FakeApiServer, kube: ApiKube
) -> None:
    server.create(config_map("ours", L.owned_labels("tiny")))
    server.create(config_map("other-deployment", L.owned_labels("other")))
    server.create(config_map("unlabelled"))
    elsewhere = config_map("elsewhere", L.owned_labels("tiny"))
    elsewhere["metadata"]["namespace"] = "other"
    server.create(elsewhere)
    selector = L.prune_selector("tiny")
    items = kube.list("v1", "ConfigMap", NS, selector)
    assert [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in items] == [
        ("v1", "ConfigMap", "ours")
    ]
    (request,) = server.requests_to("GET", f"/api/v1/namespaces/{NS}/configmaps")
    assert request.query == {"labelSelector": selector}
    assert kube.list("v1", "ConfigMap", NS, "app.kubernetes.io/name=nothing") == []


def test_delete_sends_background_propagation_and_tolerates_a_missing_object(
    server: FakeApiServer, kube: ApiKube
) -> None:
    server.create(config_map("doomed"))
    kube.delete("v1", "ConfigMap", NS, "doomed")
    assert server.get("v1", "ConfigMap", NS, "doomed") is None
    kube.delete("v1", "ConfigMap", NS, "doomed")  # already gone: 404, not an error
    requests = server.requests_to("DELETE")
    assert [r.path for r in requests] == [f"/api/v1/namespaces/{NS}/configmaps/doomed"] * 2
    assert all(r.body == {"propagationPolicy": "Background"} for r in requests)


def test_delete_pods_is_one_deletecollection_with_the_group_selector(
    server: FakeApiServer, kube: ApiKube
) -> None:
    for name, group in [("g0-0", "tiny-prefill-0"), ("g0-1", "tiny-prefill-0"), ("g1-0", "x")]:
        server.create(pod(name, L.group_selector("tiny", group)))
    selector = L.selector_string(L.group_selector("tiny", "tiny-prefill-0"))
    kube.delete_pods(NS, selector)
    (request,) = server.requests_to("DELETE")
    assert request.path == f"/api/v1/namespaces/{NS}/pods"
    assert request.query == {"labelSelector": selector}
    assert [p["metadata"]["name"] for p in server.list("v1", "Pod", NS)] == ["g1-0"]


def test_patch_status_merge_patches_the_status_subresource_only(
    server: FakeApiServer, kube: ApiKube
) -> None:
    cr = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    cr["metadata"]["namespace"] = NS
    created = server.create(cr)
    kube.patch_status(NS, "tiny", {"observedGeneration": 1, "endpoint": "http://x"})
    kube.patch_status(NS, "tiny", {"endpoint": None})
    requests = server.requests_to("PATCH")
    assert [r.path for r in requests] == [f"{CR_PATH}/tiny/status"] * 2
    assert {r.content_type for r in requests} == {"application/merge-patch+json"}
    assert requests[0].body == {"status": {"observedGeneration": 1, "endpoint": "http://x"}}
    assert requests[1].body == {"status": {"endpoint": None}}
    live = server.get(L.API_VERSION, L.KIND, NS, "tiny")
    assert live is not None and live["status"] == {"observedGeneration": 1}
    assert live["spec"] == created["spec"] and live["metadata"]["generation"] == 1


@pytest.mark.parametrize(
    ("code", "retryable"),
    [(409, True), (429, True), (500, True), (503, True), (403, False), (404, False), (422, False)],
)
def test_api_errors_map_to_kube_error(
    server: FakeApiServer, kube: ApiKube, code: int, retryable: bool
) -> None:
    kube.get("v1", "ConfigMap", NS, "warm-up")  # discovery done; the next PATCH fails
    server.fail_next(code, method="PATCH")
    with pytest.raises(KubeError) as err:
        kube.apply(config_map("c", x="1"))
    assert (err.value.retryable, err.value.status) == (retryable, code)
    assert server.get("v1", "ConfigMap", NS, "c") is None
    kube.apply(config_map("c", x="1"))  # the failure was one request only
    assert server.get("v1", "ConfigMap", NS, "c") is not None


def test_errors_of_every_verb_are_mapped(server: FakeApiServer, kube: ApiKube) -> None:
    server.create(config_map("c"))
    calls = [
        lambda: kube.get("v1", "ConfigMap", NS, "c"),
        lambda: kube.list("v1", "ConfigMap", NS, ""),
        lambda: kube.delete("v1", "ConfigMap", NS, "c"),
        lambda: kube.delete_pods(NS, "a=b"),
        lambda: kube.patch_status(NS, "tiny", {"observedGeneration": 1}),
    ]
    for call in calls:
        server.fail_next(500, path="/namespaces/")
        with pytest.raises(KubeError) as err:
            call()
        assert err.value.retryable and err.value.status == 500


def test_a_kind_the_server_does_not_serve_is_a_permanent_kube_error(kube: ApiKube) -> None:
    with pytest.raises(KubeError) as err:
        kube.get("example.com/v1", "Nothing", NS, "x")
    assert not err.value.retryable and err.value.status == 404


def test_a_kind_not_served_is_asked_about_again_only_after_a_while(
    server: FakeApiServer,
) -> None:
    """Each failed lookup makes the client refetch all of discovery: remember the answer."""
    now = [0.0]
    config = kubernetes.client.Configuration()
    config.host = server.url
    with kubernetes.client.ApiClient(config) as api_client:
        kube = ApiKube(api_client, request_timeout_s=5.0, clock=lambda: now[0])
        for _ in range(2):
            with pytest.raises(KubeError):
                kube.list("scheduling.volcano.sh/v1beta1", "PodGroup", NS, "")
        first = len(server.requests)
        assert first > 0
        now[0] = UNSERVED_RECHECK_S - 1
        with pytest.raises(KubeError):
            kube.list("scheduling.volcano.sh/v1beta1", "PodGroup", NS, "")
        assert len(server.requests) == first  # answered from memory
        now[0] = UNSERVED_RECHECK_S + 1
        with pytest.raises(KubeError) as err:
            kube.list("scheduling.volcano.sh/v1beta1", "PodGroup", NS, "")
        assert len(server.requests) > first and err.value.status == 404


def test_an_unreachable_server_is_a_retryable_kube_error(
    server: FakeApiServer, kube: ApiKube
) -> None:
    kube.get("v1", "ConfigMap", NS, "warm-up")  # v1 discovered while the server was up
    server.stop()
    with pytest.raises(KubeError) as err:
        kube.get("v1", "ConfigMap", NS, "c")
    assert err.value.retryable and err.value.status is None
    # A kind never used before needs discovery first: that failure is mapped too.
    with pytest.raises(KubeError) as err:
        kube.patch_status(NS, "tiny", {"observedGeneration": 1})
    assert err.value.retryable and err.value.status is None


def test_concurrent_reconciles_share_discovery_safely(server: FakeApiServer) -> None:
    """kopf runs handlers in threads that share one ApiKube. The DynamicClient's discovery
    cache is not thread-safe: a lookup that misses (a kind not served, such as Volcano's
    PodGroup) resets the cache while another thread fills it, which failed reconciles with
    KeyError('resources') when several CRs were reconciled at once."""
    kinds = [
        ("v1", "ConfigMap"),
        ("apps/v1", "StatefulSet"),
        ("policy/v1", "PodDisruptionBudget"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("scheduling.volcano.sh/v1beta1", "PodGroup"),  # not served: a miss
        ("scheduling.x-k8s.io/v1alpha1", "PodGroup"),  # not served: a miss
        (L.API_VERSION, L.KIND),
        ("v1", "Service"),
    ]
    for _round in range(6):
        assert _lookups_at_once(server, kinds) == []


def _lookups_at_once(server: FakeApiServer, kinds: list[tuple[str, str]]) -> list[BaseException]:
    """Each kind listed by its own thread, all released at once, through one ApiKube with a
    cold discovery cache; the failures other than a kind not served (404)."""
    config = kubernetes.client.Configuration()
    config.host = server.url
    start = threading.Barrier(len(kinds))
    failures: list[BaseException] = []
    with kubernetes.client.ApiClient(config) as api_client:
        kube = ApiKube(api_client, request_timeout_s=5.0)

        def lookup(api_version: str, kind: str) -> None:
            start.wait()
            try:
                kube.list(api_version, kind, NS, "")
            except KubeError as exc:
                if exc.status != 404:
                    failures.append(exc)
            except Exception as exc:
                failures.append(exc)

        threads = [threading.Thread(target=lookup, args=k) for k in kinds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    return failures
