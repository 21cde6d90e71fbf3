"""The fake API server stores built-in objects as the real one does (support/builtin_defaults.py):
decoded into their Go types (zero values of omitempty fields and nulls gone) and defaulted
(restated from kubernetes pkg/apis/{core,apps,networking}/v1/defaults.go). And every object the
operator renders, applied to it, still holds what the operator planned: no re-apply once
converged, for every sample."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support import builtin_defaults as B
from support.fake_apiserver import FakeApiServer
from support.fake_http import APPLY, call, ok, owned
from support.rendered import rendered_objects

from dsv4_operator import labels as L
from dsv4_operator.diff import holds, needs_apply

NS = "/api/v1/namespaces/default"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as srv:
        yield srv


def create(server: FakeApiServer, path: str, body: dict[str, Any]) -> Any:
    return ok(call(server, "POST", path, body))


CONTAINER = {
    "name": "w",
    "image": "worker:1",
    "ports": [{"name": "http", "containerPort": 8000}],
    "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    "readinessProbe": {"httpGet": {"port": "http"}},
    "livenessProbe": {"exec": {"command": ["true"]}, "initialDelaySeconds": 0},
    "args": [],
}
TEMPLATE = {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [CONTAINER]}}


def test_workloads_get_the_defaults_of_their_kind_and_pod_template(server: FakeApiServer) -> None:
    sts = create(
        server,
        "/apis/apps/v1/namespaces/default/statefulsets",
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "w"},
            "spec": {"selector": {"matchLabels": {"app": "w"}}, "template": TEMPLATE},
        },
    )["spec"]
    assert {k: v for k, v in sts.items() if k not in ("selector", "template")} == {
        "replicas": 1,
        "podManagementPolicy": "OrderedReady",
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
        "revisionHistoryLimit": 10,
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
    }
    pod = sts["template"]["spec"]
    assert {k: v for k, v in pod.items() if k != "containers"} == {
        "restartPolicy": "Always",
        "dnsPolicy": "ClusterFirst",
        "securityContext": {},
        "terminationGracePeriodSeconds": 30,
        "schedulerName": "default-scheduler",
    }  # no enableServiceLinks: that default is the Pod's, not the template's
    (container,) = pod["containers"]
    assert container == {
        "name": "w",
        "image": "worker:1",
        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
        "env": [
            {
                "name": "POD",
                "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
            }
        ],
        "readinessProbe": {
            "httpGet": {"port": "http", "path": "/", "scheme": "HTTP"},
            "timeoutSeconds": 1,
            "periodSeconds": 10,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "livenessProbe": {  # initialDelaySeconds 0 and args [] are not stored (omitempty)
            "exec": {"command": ["true"]},
            "timeoutSeconds": 1,
            "periodSeconds": 10,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "resources": {},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }
    deploy = create(
        server,
        "/apis/apps/v1/namespaces/default/deployments",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "r"},
            "spec": {"selector": {"matchLabels": {"app": "w"}}, "template": TEMPLATE},
        },
    )["spec"]
    assert (deploy["replicas"], deploy["revisionHistoryLimit"]) == (1, 10)
    assert deploy["progressDeadlineSeconds"] == 600
    assert deploy["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
    }


def test_pods_get_service_links_and_requests_from_limits(server: FakeApiServer) -> None:
    container = {"name": "w", "image": "w", "resources": {"limits": {"memory": "1Gi"}}}
    pod = create(
        server,
        f"{NS}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"containers": [container]},
        },
    )["spec"]
    assert pod["enableServiceLinks"] is True
    (stored,) = pod["containers"]
    assert stored["resources"] == {"limits": {"memory": "1Gi"}, "requests": {"memory": "1Gi"}}
    assert stored["imagePullPolicy"] == "Always"  # no tag: latest


@pytest.mark.parametrize(
    ("image", "policy"),
    [
        ("worker", "Always"),
        ("worker:latest", "Always"),
        ("registry:5000/team/worker", "Always"),
        ("worker:1.2", "IfNotPresent"),
        ("registry:5000/team/worker:v1", "IfNotPresent"),
        ("worker@sha256:" + "a" * 64, "IfNotPresent"),
        ("worker:latest@sha256:" + "a" * 64, "Always"),
    ],
)
def test_the_pull_policy_follows_the_image_tag(image: str, policy: str) -> None:
    assert ("Always" if B.image_tag(image) == "latest" else "IfNotPresent") == policy


def test_services_get_their_defaults_and_keep_the_allocated_ip(server: FakeApiServer) -> None:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "labels": {}},
        "spec": {
            "selector": {"app": "w"},
            "ports": [{"port": 80}, {"port": 81, "targetPort": "http"}],
            "publishNotReadyAddresses": False,
        },
    }
    svc = create(server, f"{NS}/services", body)
    spec = svc["spec"]
    assert "labels" not in svc["metadata"] and "publishNotReadyAddresses" not in spec
    assert spec["ports"] == [
        {"port": 80, "protocol": "TCP", "targetPort": 80},
        {"port": 81, "targetPort": "http", "protocol": "TCP"},
    ]
    assert (spec["type"], spec["sessionAffinity"], spec["internalTrafficPolicy"]) == (
        "ClusterIP",
        "None",
        "Cluster",
    )
    ip = spec["clusterIP"]
    assert ip.startswith("10.96.") and spec["clusterIPs"] == [ip]
    assert (spec["ipFamilies"], spec["ipFamilyPolicy"]) == (["IPv4"], "SingleStack")
    # A replace that omits the allocated IP keeps it.
    replaced = {**svc, "spec": {"selector": {"app": "w"}, "ports": [{"port": 80}]}}
    again = ok(call(server, "PUT", f"{NS}/services/s", replaced))
    assert again["spec"]["clusterIP"] == ip
    headless = {**body, "metadata": {"name": "h"}, "spec": {**body["spec"], "clusterIP": "None"}}
    assert create(server, f"{NS}/services", headless)["spec"]["clusterIPs"] == ["None"]


def test_network_policies_default_their_types_and_port_protocols(server: FakeApiServer) -> None:
    policy = create(
        server,
        "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies",
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "n"},
            "spec": {
                "podSelector": {"matchLabels": {}},
                "ingress": [{"from": [{"namespaceSelector": {}}], "ports": [{"port": 80}]}],
            },
        },
    )["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"] == {}  # an empty map is not stored; the struct is
    assert policy["ingress"] == [
        {"from": [{"namespaceSelector": {}}], "ports": [{"port": 80, "protocol": "TCP"}]}
    ]


def test_an_applier_does_not_own_the_defaults(server: FakeApiServer) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s"},
        "spec": {"selector": {"app": "w"}, "ports": [{"port": 80}]},
    }
    url = f"{NS}/services/s?fieldManager="
    first = ok(call(server, "PATCH", url + "a", body, APPLY))
    assert first["spec"]["sessionAffinity"] == "None"
    assert "f:sessionAffinity" not in owned(first, "a")["f:spec"]
    sticky = {**body, "spec": {"sessionAffinity": "ClientIP"}}
    changed = ok(call(server, "PATCH", url + "b", sticky, APPLY))  # no conflict: unowned
    assert changed["spec"]["sessionAffinity"] == "ClientIP"


SERVED = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("batch/v1", "Job"): "jobs",  # an hf:// sample's download
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
}


def test_every_rendered_object_holds_as_the_server_stores_it(server: FakeApiServer) -> None:
    """Each object of each sample, server-side applied as the operator applies it: the stored
    object (canonical quantities, defaults, omitted zero values) holds the plan, so the
    operator does not apply it again; applying it again anyway writes nothing."""
    checked = 0
    for obj in rendered_objects():
        plural = SERVED.get((obj["apiVersion"], obj["kind"]))
        if plural is None:
            continue  # an add-on's kind (Volcano's PodGroup)
        group, _, version = obj["apiVersion"].rpartition("/")
        base = f"/apis/{group}/{version}" if group else f"/api/{version}"
        meta = obj["metadata"]
        url = (
            f"{base}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"
            f"?fieldManager={L.FIELD_MANAGER}&force=true"
        )
        if server.get("v1", "Namespace", "", meta["namespace"]) is None:
            namespace = {"apiVersion": "v1", "kind": "Namespace"}
            server.create({**namespace, "metadata": {"name": meta["namespace"]}})
        stored = ok(call(server, "PATCH", url, obj, APPLY))
        where = (obj["kind"], meta["name"])
        assert holds(stored, obj), where
        assert not needs_apply(obj, stored), where
        assert ok(call(server, "PATCH", url, obj, APPLY)) == stored, where
        call(server, "DELETE", url.split("?")[0])
        checked += 1
    assert checked > 50
