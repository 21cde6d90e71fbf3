"""The chart grants the operator exactly the verbs its code uses: read from the code, not kept
by hand. Two sources, both the code's own:

- kopf's registry of our handlers (`dsv4_operator.main`): every resource a handler watches,
  indexes or times is listed and watched; a resource with change or timer handlers is patched
  (kopf's finalizer and progress annotations); logger warnings become Events (created).
- Every call the reconcile and the admission webhook make through the `Kube` protocol, recorded
  over scenarios that reach each call site (create, converge, restart a group, prune, a
  configMapRef model, gang PodGroups, the Inference Extension's objects, HPA/KEDA scalers,
  admission), as the API server authorizes them: an apply that creates is `create`, one that
  updates `patch`; `create` (the PD Secret) is `create` whether or not the object exists;
  `delete_pods` is `deletecollection`; `patch_status` is `patch` on `/status`.

Two grants are needed by the API server rather than called: `delete` on every managed kind
(prune deletes any object of those kinds that carries our labels and is no longer planned, and
OwnerReferencesPermissionEnforcement wants `delete` to change an object's ownerReferences) and
`update` on `dsv4deployments/finalizers` (the same plugin, for blockOwnerDeletion); both are
shown by test_fake_rbac.py. Peering's rules (kopf's, replicaCount > 1) are checked there too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from kopf._core.intents import registries
from support.chart_support import needs_helm, render
from support.fake_kube import FakeKube, FakeProbe

from dsv4_common.api.model_source import HfSource
from dsv4_operator import admission
from dsv4_operator import labels as L
from dsv4_operator import main as operator_main
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.handlers import Deps, reconcile_owner, run_reconcile
from dsv4_operator.objects import MANAGED_KINDS
from dsv4_operator.weights import Resolved

Grant = tuple[str, str]  # (API group, resource[/subresource])
LOG = __import__("logging").getLogger("test")
PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "PodGroup": "podgroups",
    "InferencePool": "inferencepools",
    "HTTPRoute": "httproutes",
    "DSV4RoleScaler": "dsv4rolescalers",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "Pod": "pods",
    "Job": "jobs",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Secret": "secrets",
    L.KIND: L.PLURAL,
}
TINY_CONFIG = (
    __import__("pathlib").Path(__file__).resolve().parents[2]
    / "worker/dsv4_worker/models/tiny/config.json"
).read_text()


def _grant(api_version: str, kind: str) -> Grant:
    return (api_version.rpartition("/")[0], PLURALS[kind])


class RecordingKube:
    """A `Kube` that records each call as the API server's authorizer sees it."""

    def __init__(self, inner: FakeKube) -> None:
        self.inner = inner
        self.calls: set[tuple[str, str, str]] = set()

    def _note(self, grant: Grant, verb: str) -> None:
        self.calls.add((*grant, verb))

    def apply(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        exists = self.inner.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        self._note(_grant(obj["apiVersion"], obj["kind"]), "patch" if exists else "create")
        self.inner.apply(obj)

    def create(self, obj: Mapping[str, Any]) -> bool:
        self._note(_grant(obj["apiVersion"], obj["kind"]), "create")  # (409 if it exists)
        return self.inner.create(obj)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        self._note(_grant(api_version, kind), "get")
        return self.inner.get(api_version, kind, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> Any:
        self._note(_grant(api_version, kind), "list")
        return self.inner.list(api_version, kind, namespace, selector)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._note(_grant(api_version, kind), "delete")
        self.inner.delete(api_version, kind, namespace, name)

    def delete_pods(self, namespace: str, selector: str) -> None:
        self._note(("", "pods"), "deletecollection")
        self.inner.delete_pods(namespace, selector)

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self._note((L.GROUP, f"{L.PLURAL}/status"), "patch")
        self.inner.patch_status(namespace, name, patch)


def _drift(kube: FakeKube) -> None:
    """Someone else's edit of every child the operator applied (its applied-hash is gone)."""
    for (_, kind, _, _), obj in kube.objects.items():
        if kind != "Pod":
            obj["metadata"].get("annotations", {}).pop(L.APPLIED_HASH_ANNOTATION, None)
            obj["metadata"].setdefault("labels", {})["edited"] = "by-hand"


def _applied_drifted_then(
    body: dict[str, Any], change: Callable[[dict[str, Any]], object]
) -> RecordingKube:
    """Reconciled from `body`, again after every child drifted, then again after `change`
    edited a copy of the spec (what it applies, re-applies and prunes, recorded)."""
    kube = RecordingKube(FakeKube(body))
    deps = Deps(kube, FakeProbe(), OperatorConfig(), ReconcileGate())
    run_reconcile(kube.inner.cr, deps, LOG)
    _drift(kube.inner)
    run_reconcile(kube.inner.cr, deps, LOG)
    changed = copy.deepcopy(kube.inner.cr)
    change(changed["spec"])
    kube.inner.cr = changed
    run_reconcile(kube.inner.cr, deps, LOG)
    return kube


def _scenarios(make_body: Callable[..., dict[str, Any]]) -> Iterator[RecordingKube]:
    """Each call site of the reconcile and the webhook, reached once at least."""
    # Create, converge (status), a broken pod's group restarted, replicas scaled down (prune).
    kube = RecordingKube(FakeKube(make_body()))
    probe = FakeProbe()
    deps = Deps(kube, probe, OperatorConfig(), ReconcileGate())
    run_reconcile(kube.inner.cr, deps, LOG)
    kube.inner.run_controllers()
    probe.report_planned(kube.inner)
    run_reconcile(kube.inner.cr, deps, LOG)
    _drift(kube.inner)  # every child edited by someone else: re-applied (patched)
    run_reconcile(kube.inner.cr, deps, LOG)
    pod = sorted(kube.inner.of_kind("Pod"))[0]
    kube.inner.set_pod(pod, restarts=1)
    reconcile_owner("ns", "tiny", deps, LOG)
    kube.inner.cr["spec"]["decode"]["replicas"] = 2
    run_reconcile(kube.inner.cr, deps, LOG)
    kube.inner.cr["spec"]["decode"]["replicas"] = 1
    kube.inner.cr["metadata"]["generation"] += 1
    run_reconcile(kube.inner.cr, deps, LOG)
    yield kube
    # Gang-scheduled groups: PodGroups of both schedulers, the other's pruned.
    for gang in ("volcano", "coscheduling"):
        body = make_body("flash-h200-volcano.yaml")
        body["spec"]["scheduling"]["gang"] = gang
        body["spec"]["scheduling"].pop("queue", None) if gang != "volcano" else None
        yield _applied_drifted_then(body, lambda spec: spec.update(scheduling={"gang": "none"}))
    # The Inference Extension's objects: applied, re-applied after an edit, pruned.
    body = make_body()
    body["spec"]["gateway"] = {
        "endpointPicker": {"name": "epp"},
        "parentRefs": [{"name": "gw"}],
        "allowFromNamespaces": ["gateway-system"],
    }
    yield _applied_drifted_then(body, lambda spec: spec.pop("gateway"))
    # An HPA's or KEDA's targets: each role's scaler read, applied with its HPA or
    # ScaledObject, re-applied after an edit, pruned when the operator scales again.
    for engine in ("hpa", "keda"):
        body = make_body()
        body["spec"]["decode"]["autoscaling"] = {"maxReplicas": 2, "queueDepthPerReplica": 4}
        body["spec"]["autoscaling"] = {"engine": engine}
        if engine == "keda":
            body["spec"]["autoscaling"]["prometheusAddress"] = "http://prometheus:9090"
        yield _applied_drifted_then(
            body, lambda spec: spec.update(autoscaling={"engine": "operator"})
        )
    # A configMapRef model: read from the API, by the reconcile and by the webhook.
    body = make_body("flash-configmap.yaml")
    kube = RecordingKube(FakeKube(body))
    deps = Deps(kube, FakeProbe(), OperatorConfig(), ReconcileGate())
    run_reconcile(kube.inner.cr, deps, LOG)
    request = admission.AdmissionRequest("CREATE", body, None, None)
    admission.review(request, resolve=admission.cluster_resolver("ns", kube))
    yield kube
    yield from _hf_scenarios(make_body)


class _Hub:
    """The hub port: every revision is the commit its table names (or itself)."""

    def __init__(self) -> None:
        self.refs = {"main": "a" * 40}

    def resolve(self, source: HfSource, *, endpoint: str | None, token: str | None) -> Resolved:
        commit = self.refs.get(source.revision, source.revision)
        return Resolved(source, commit, 1 << 30, 5, TINY_CONFIG)


def _hf_scenarios(make_body: Callable[..., dict[str, Any]]) -> Iterator[RecordingKube]:
    """An hf:// source: its token Secret read, the shared download applied and observed, a
    running Job whose template changed recreated, the workers built once it completes, and the
    download of a revision left behind pruned; a claim a CR names read."""
    body = make_body()
    body["spec"]["model"] = {
        "source": "hf://acme/tiny@main",
        "hub": {"tokenSecretRef": {"name": "hf"}},
    }
    kube = RecordingKube(FakeKube(body))
    secret = {
        "metadata": {"name": "hf", "namespace": "ns", "labels": {L.HUB_TOKEN_LABEL: "true"}},
        "data": {"HF_TOKEN": "aGZfYWJj"},
    }
    kube.inner.objects[("v1", "Secret", "ns", "hf")] = secret
    hub = _Hub()
    deps = Deps(kube, FakeProbe(), OperatorConfig(), ReconcileGate(), hub=hub)
    run_reconcile(kube.inner.cr, deps, LOG)
    _drift(kube.inner)
    run_reconcile(kube.inner.cr, deps, LOG)
    (job,) = kube.inner.of_kind("Job").values()
    job["spec"]["template"]["metadata"]["annotations"][L.TEMPLATE_HASH_ANNOTATION] = "old"
    run_reconcile(kube.inner.cr, deps, LOG)  # deleted, to be created again
    run_reconcile(kube.inner.cr, deps, LOG)
    (job,) = kube.inner.of_kind("Job").values()
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    run_reconcile(kube.inner.cr, deps, LOG)  # the workers
    body = kube.inner.cr
    body["spec"]["model"]["source"] = "hf://acme/tiny@v2"
    body["metadata"]["generation"] += 1
    run_reconcile(body, deps, LOG)
    for job in kube.inner.of_kind("Job").values():
        job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    run_reconcile(body, deps, LOG)  # ready at v2: the download of main, its alone, pruned
    yield kube
    body = make_body()
    body["spec"]["model"] = {"source": "hf://acme/tiny", "cache": {"persistentVolumeClaim": "m"}}
    kube = RecordingKube(FakeKube(body))
    deps = Deps(kube, FakeProbe(), OperatorConfig(), ReconcileGate(), hub=_Hub())
    run_reconcile(kube.inner.cr, deps, LOG)
    yield kube


def _kopf_calls() -> set[tuple[str, str, str]]:
    assert operator_main.handlers  # registered in kopf's default registry
    registry = registries.get_default_registry()
    calls: set[tuple[str, str, str]] = {("", "events", "create")}  # posted logger warnings
    observing = (registry._watching, registry._indexing, registry._spawning, registry._changing)
    for sub in observing:
        for handler in sub._handlers:
            grant = (handler.selector.group, handler.selector.any_name)
            calls |= {(*grant, "list"), (*grant, "watch")}
            if sub in (registry._spawning, registry._changing):
                calls.add((*grant, "patch"))  # the finalizer, progress and diff-base annotations
    return calls


def code_grants(make_body: Callable[..., dict[str, Any]]) -> dict[Grant, set[str]]:
    calls = _kopf_calls()
    for kube in _scenarios(make_body):
        calls |= kube.calls
    for api_version, kind in MANAGED_KINDS:  # prune's contract (see the docstring)
        calls.add((*_grant(api_version, kind), "delete"))
    calls.add((L.GROUP, f"{L.PLURAL}/finalizers", "update"))  # OwnerReferences... (docstring)
    out: dict[Grant, set[str]] = {}
    for group, resource, verb in calls:
        out.setdefault((group, resource), set()).add(verb)
    return out


def _grants(role: dict[str, Any]) -> dict[Grant, set[str]]:
    out: dict[Grant, set[str]] = {}
    for rule in role["rules"]:
        if rule["apiGroups"] == ["zalando.org"]:
            continue  # peering: kopf's (test_fake_rbac.py)
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@needs_helm
@pytest.mark.parametrize(
    ("values", "kind"),
    [((), "ClusterRole"), (("--set", "rbac.namespaced=true"), "Role")],
    ids=["cluster-wide", "namespaced"],
)
def test_the_chart_grants_exactly_what_the_code_calls(
    make_body: Callable[..., dict[str, Any]], values: tuple[str, ...], kind: str
) -> None:
    needed = code_grants(make_body)
    (role,) = [
        o
        for o in render(*values, "--set", "replicaCount=2")
        if o["kind"] == kind and o["metadata"]["name"] == "dsv4-dsv4-operator"
    ]
    granted = _grants(role)
    unused = {k: sorted(v - needed.get(k, set())) for k, v in granted.items()}
    missing = {k: sorted(v - granted.get(k, set())) for k, v in needed.items()}
    assert {k: v for k, v in unused.items() if v} == {}, "granted, never used"
    assert {k: v for k, v in missing.items() if v} == {}, "used, not granted"


def test_the_code_reads_only_what_it_must(make_body: Callable[..., dict[str, Any]]) -> None:
    """What `get` is for: the CR itself (read afresh under its lock), a configMapRef's
    ConfigMap, the router's Deployment, (engine hpa or keda) each role's DSV4RoleScaler, for
    the replicas the HPA set, and for an hf:// source a claim the CR names and the one Secret its
    tokenSecretRef names (by name, never listed); nothing reads a namespace. The other Secret
    verb is `create`: each deployment's PD secret, never read back."""
    needed = code_grants(make_body)
    reads = {k for k, v in needed.items() if "get" in v}
    assert reads == {
        (L.GROUP, L.PLURAL),
        ("", "configmaps"),
        ("apps", "deployments"),
        (L.GROUP, "dsv4rolescalers"),
        ("", "persistentvolumeclaims"),
        ("", "secrets"),
    }
    assert needed.get(("", "secrets")) == {"create", "get"}
    assert not any(resource in ("namespaces", "nodes") for _, resource in needed)
