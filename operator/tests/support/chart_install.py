"""Installing the chart into the fake API server the way the tools send it, over HTTP as the
cluster admin: the CRD POSTed from crds/ (what `helm install` and `kubectl create -f crds/` do),
then waited on until Established (as helm waits for its CRDs); then every object of
`helm template` server-side applied with field manager `helm`, in helm's install order (helm 4
applies server-side by default: `helm install --server-side`, default true). The operator's
credentials are a token of the chart's ServiceAccount, so its Roles and bindings decide what it
may do (support/rbac.py)."""

from __future__ import annotations

import functools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from support.chart_support import render
from support.fake_apiserver import FakeApiServer

Obj = Mapping[str, Any]

RELEASE_NAMESPACE: Final = "dsv4-system"  # chart_support.render's --namespace
# helm pkg/release/v1/util/kind_sorter.go, InstallOrder (the kinds the chart renders, and
# their neighbours); other kinds go last.
HELM_INSTALL_ORDER: Final = (
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "ConfigMap", "StorageClass",
    "PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole",
    "ClusterRoleBinding", "Role", "RoleBinding", "Service", "DaemonSet", "Pod", "ReplicaSet",
    "Deployment", "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "Ingress",
    "APIService", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
)  # fmt: skip


@functools.cache
def rendered(values: tuple[str, ...]) -> tuple[Obj, ...]:
    """`helm template` of the chart with these flags (cached: helm takes a while)."""
    return tuple(render(*values))


def request(
    server: FakeApiServer,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    token: str | None = None,
) -> tuple[int, Any]:
    """One HTTP request, as the admin (no credentials) or with a bearer `token`:
    (status, parsed body)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    sent = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(sent, timeout=30) as rsp:
            return rsp.status, _parsed(rsp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _parsed(exc.read())


def _parsed(raw: bytes) -> Any:
    """A JSON body; a watch stream's lines as a list of events; None when empty."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return [json.loads(line) for line in raw.splitlines() if line.strip()]


def object_path(server: FakeApiServer, obj: Obj, namespace: str = RELEASE_NAMESPACE) -> str:
    """The REST path of `obj` (namespaced kinds in their namespace, or `namespace`)."""
    rtype = server.rtype(obj["apiVersion"], obj["kind"])
    prefix = f"/apis/{rtype.api_version}" if rtype.group else f"/api/{rtype.api_version}"
    if rtype.namespaced:
        prefix += f"/namespaces/{obj['metadata'].get('namespace') or namespace}"
    return f"{prefix}/{rtype.plural}/{obj['metadata']['name']}"


def create_crd(server: FakeApiServer, crd: Obj, timeout_s: float = 30.0) -> Obj:
    """POST the CRD, then wait for its Established condition; the CRD as the server holds it."""
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    code, created = request(server, "POST", path, crd)
    assert code == 201, created
    deadline = time.monotonic() + timeout_s
    while True:
        code, got = request(server, "GET", f"{path}/{crd['metadata']['name']}")
        conditions = (got.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return dict(got)
        assert time.monotonic() < deadline, f"the CRD was not Established: {got}"
        time.sleep(0.05)


def install(server: FakeApiServer, objects: Iterable[Obj]) -> None:
    """Apply every object server-side as helm 4 does, in helm's install order."""

    def rank(obj: Obj) -> int:
        kind = obj["kind"]
        return HELM_INSTALL_ORDER.index(kind) if kind in HELM_INSTALL_ORDER else 999

    for obj in sorted(objects, key=rank):
        path = f"{object_path(server, obj)}?fieldManager=helm"
        code, body = request(server, "PATCH", path, obj, "application/apply-patch+yaml")
        assert code in (200, 201), (obj["kind"], obj["metadata"]["name"], body)


def service_account(objects: Sequence[Obj]) -> tuple[str, str]:
    """(namespace, name) of the operator's ServiceAccount: its StatefulSet's."""
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    name = sts["spec"]["template"]["spec"]["serviceAccountName"]
    return sts["metadata"].get("namespace") or RELEASE_NAMESPACE, name


def operator_env(objects: Sequence[Obj]) -> dict[str, str]:
    """The literal environment variables of the chart's operator container."""
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
