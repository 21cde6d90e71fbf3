"""The Helm chart: lints, renders, every object passes kubernetes-validate (1.30 and 1.37, strict),
RBAC is least-privilege in both modes, CRDs reach the cluster on upgrade when asked to.

helm comes from scripts/tools.sh (.tools/bin/helm); the tests skip, saying so, only when it is
missing, which CI never allows (scripts/setup.sh runs tools.sh).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
import yaml
from repo_paths import CRD_FILE
from support import crd_support as S
from support.chart_support import CHART, K8S_VERSIONS, helm, needs_helm, render

from dsv4_operator import labels as L
from dsv4_operator.objects import MANAGED_KINDS
from dsv4_operator.render import render as render_cr

# Value sets the chart must render cleanly with.
VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    "namespaced": ["--set", "rbac.namespaced=true"],
    "watch-list": ["--set", "watch.namespaces={team-a,team-b}"],
    "ha": ["--set", "replicaCount=3"],
    "ha-namespaced": ["--set", "replicaCount=2", "--set", "rbac.namespaced=true"],
    "managed-crds": ["--set", "crds.manage=true"],
    "baseline-pod-security": ["--set", "crds.manage=true", "--set", "podSecurity.level=baseline"],
    "no-rbac": ["--set", "rbac.create=false", "--set", "serviceAccount.create=false"],
    "model-config-volume": [
        "--set",
        "extraVolumes[0].name=pro-config",
        "--set",
        "extraVolumes[0].configMap.name=dsv4-pro-config",
        "--set",
        "extraVolumeMounts[0].name=pro-config",
        "--set",
        "extraVolumeMounts[0].mountPath=/models/DeepSeek-V4-Pro",
        "--set",
        "extraVolumeMounts[0].readOnly=true",
    ],
    "no-network-policy": ["--set", "networkPolicy.enabled=false"],
    "by-digest": [
        "--set",
        f"image.digest=sha256:{'a' * 64}",
        "--set",
        f"workerImage.digest=sha256:{'b' * 64}",
    ],
}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


# --- files -----------------------------------------------------------------------------------


def test_chart_crd_is_a_byte_identical_copy() -> None:
    for name in (CRD_FILE.name, "dsv4rolescaler.yaml"):
        top = (CRD_FILE.parent / name).read_bytes()
        assert (CHART / "crds" / name).read_bytes() == top, (
            f"copy crds/{name} to charts/dsv4-operator/crds/"
        )


# Blocks whose content is a plain Kubernetes structure, documented by the block's comment.
PASSTHROUGH = {"resources", "podSecurityContext", "securityContext"}


def test_every_values_key_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    parent = ""
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        key = stripped.split(":", 1)[0]
        if indent == 0:
            parent = key
        group = indent == 0 and stripped.endswith(":") and parent not in PASSTHROUGH
        if group or (indent > 0 and parent in PASSTHROUGH):
            continue
        assert lines[i - 1].strip().startswith("#"), f"values.yaml:{i + 1} {key!r} has no comment"


# --- helm ------------------------------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name: str) -> None:
    helm("lint", "--strict", str(CHART), *VALUE_SETS[name])


@needs_helm
@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_pass_kubernetes_validate(name: str, k8s: str) -> None:
    objects = render(*VALUE_SETS[name], include_crds=True)
    assert objects
    peering_crds = {
        o["spec"]["names"]["kind"]: o for o in by_kind(objects, "CustomResourceDefinition")
    }
    for obj in objects:
        if obj["apiVersion"] == "zalando.org/v1":
            # A custom resource: kubernetes-validate has no schema; use its CRD's.
            schema = S.crd_schema(peering_crds[obj["kind"]])
            assert S.validate_cr(obj, schema) == [], obj
            continue
        kubernetes_validate.validate(obj, k8s, strict=True)


@needs_helm
def test_operator_pod_is_locked_down() -> None:
    (sts,) = by_kind(render(), "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert container["command"] == ["kopf", "run", "-m", "dsv4_operator.main"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--standalone" in container["args"] and "--all-namespaces" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSV4_PEERING"] == ""  # standalone for dsv4_operator.settings too


# --- the operator pod's probes, NetworkPolicy and images (checkov, see README.md) -------------


def _ingress_ports(policy: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Port name -> the `from` peers of the rule admitting it ([] for anywhere)."""
    return {
        port["port"]: rule.get("from", [])
        for rule in policy["spec"].get("ingress") or []
        for port in rule["ports"]
    }


@needs_helm
@pytest.mark.parametrize(
    ("values", "admitted"),
    [
        ([], {"metrics": "monitoring"}),
        (["--set", "webhook.enabled=true"], {"metrics": "monitoring", "webhook": None}),
        (["--set", "metrics.scrapeNamespace=prom"], {"metrics": "prom"}),
        (["--set", "metrics.scrapeNamespace="], {}),
        (["--set", "metrics.port=0", "--set", "webhook.enabled=true"], {"webhook": None}),
        (["--set", "replicaCount=2", "--set", "rbac.namespaced=true"], {"metrics": "monitoring"}),
    ],
)
def test_operator_pods_have_an_ingress_only_network_policy(
    values: list[str], admitted: dict[str, str | None]
) -> None:
    """checkov CKV2_K8S_6. The webhook port from anywhere (the API server's address matches no
    selector), the metrics port from the scrapers' namespace, nothing else (the kubelet's
    probes come from the node, always allowed). Egress stays open: the operator must reach the
    API server and the workers' status ports."""
    objects = render(*values)
    (policy,) = by_kind(objects, "NetworkPolicy")
    (sts,) = by_kind(objects, "StatefulSet")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == sts["metadata"]["namespace"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    ports = _ingress_ports(policy)
    assert set(ports) == set(admitted)
    container_ports = {p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert set(ports) <= container_ports  # named ports the container declares
    for port, namespace in admitted.items():
        expected = (
            []
            if namespace is None
            else [{"namespaceSelector": {"matchLabels": {L.NAMESPACE_NAME_LABEL: namespace}}}]
        )
        assert ports[port] == expected


@needs_helm
def test_the_network_policy_can_be_turned_off() -> None:
    assert not by_kind(render(*VALUE_SETS["no-network-policy"]), "NetworkPolicy")


@needs_helm
def test_operator_readiness_asks_kopf_health_endpoint() -> None:
    """checkov CKV_K8S_9: ready once kopf serves --liveness (after its start-up handlers); with
    the webhook on, once the webhook port accepts connections (test_chart_webhook.py)."""
    (sts,) = by_kind(render("--set", "livenessPort=8181"), "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--liveness=http://0.0.0.0:8181/healthz" in container["args"]
    probe = container["readinessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {"name": "healthz", "containerPort": 8181, "protocol": "TCP"} in container["ports"]
    assert probe["httpGet"] == container["livenessProbe"]["httpGet"]


@needs_helm
def test_images_can_be_pinned_by_digest() -> None:
    """checkov CKV_K8S_43: `image.digest` / `workerImage.digest` replace the tag."""
    (sts,) = by_kind(render(*VALUE_SETS["by-digest"]), "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/dsv4-serve/operator@sha256:{'a' * 64}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSV4_WORKER_IMAGE"] == f"ghcr.io/dsv4-serve/worker@sha256:{'b' * 64}"
    (sts,) = by_kind(
        render("--set", "image.tag=1.2.3", "--set", "workerImage.tag=7"), "StatefulSet"
    )
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/dsv4-serve/operator:1.2.3"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSV4_WORKER_IMAGE"] == "ghcr.io/dsv4-serve/worker:7"


@needs_helm
def test_model_config_volume_reaches_the_operator_container() -> None:
    """A `model.configPath` CR is planned by the operator: its config.json must be mountable."""
    (sts,) = by_kind(render(*VALUE_SETS["model-config-volume"]), "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert {"name": "pro-config", "configMap": {"name": "dsv4-pro-config"}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {
        "name": "pro-config",
        "mountPath": "/models/DeepSeek-V4-Pro",
        "readOnly": True,
    } in mounts
    assert {"name": "tmp", "mountPath": "/tmp"} in mounts  # the default mount stays


@needs_helm
def test_ha_uses_peering_with_distinct_priorities() -> None:
    objects = render("--set", "replicaCount=3")
    (sts,) = by_kind(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=dsv4-operator" in args and "--standalone" not in args
    # Same-priority kopf peers all pause: each pod's priority is minus its StatefulSet index.
    assert "--priority=-$(DSV4_POD_INDEX)" in args
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DSV4_POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    # dsv4_operator.settings reads the same choices from the environment.
    assert env["DSV4_PEERING"]["value"] == "dsv4-operator"
    assert env["DSV4_PEERING_CLUSTERWIDE"]["value"] == "true"
    assert env["DSV4_PRIORITY"]["value"] == "-$(DSV4_POD_INDEX)"
    (peering,) = by_kind(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "dsv4-operator"
    (role,) = [
        r
        for r in by_kind(objects, "ClusterRole")
        if not r["metadata"]["name"].endswith("crd-reader")
    ]
    assert {
        "apiGroups": ["zalando.org"],
        "resources": ["clusterkopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    } in role["rules"]


@needs_helm
def test_peering_crds_ship_with_the_chart() -> None:
    crds = by_kind(render(include_crds=True), "CustomResourceDefinition")
    names = {c["metadata"]["name"] for c in crds}
    assert names == {
        "dsv4deployments.serving.dsv4.io",
        "dsv4rolescalers.serving.dsv4.io",
        "clusterkopfpeerings.zalando.org",
        "kopfpeerings.zalando.org",
    }


# --- RBAC ------------------------------------------------------------------------------------

EXPECTED_RULES = {
    ("serving.dsv4.io", "dsv4deployments"): {"get", "list", "watch", "patch"},
    ("serving.dsv4.io", "dsv4deployments/status"): {"patch"},
    **{
        (group, res): {"list", "create", "patch", "delete"}
        for group, res in [
            ("apps", "statefulsets"),
            ("", "services"),
            ("", "serviceaccounts"),
            ("policy", "poddisruptionbudgets"),
            ("networking.k8s.io", "networkpolicies"),
            ("scheduling.volcano.sh", "podgroups"),
            ("scheduling.x-k8s.io", "podgroups"),
            ("inference.networking.k8s.io", "inferencepools"),
            ("gateway.networking.k8s.io", "httproutes"),
            ("autoscaling", "horizontalpodautoscalers"),
            ("keda.sh", "scaledobjects"),
        ]
    },
    ("serving.dsv4.io", "dsv4rolescalers"): {"get", "list", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch", "deletecollection"},
    ("", "events"): {"create"},
    # The deployment's PD secret (created, never read back) and the one Secret an hf://
    # source's tokenSecretRef names (read by name).
    ("", "secrets"): {"create", "get"},
    ("serving.dsv4.io", "dsv4deployments/finalizers"): {"update"},
    # hf:// sources: the shared download Job and the cache claim.
    ("batch", "jobs"): {"list", "watch", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"get", "list", "create", "patch", "delete"},
}


def _grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


@needs_helm
def test_cluster_mode_grants_exactly_the_workload_verbs() -> None:
    objects = render()
    roles = {r["metadata"]["name"]: r for r in by_kind(objects, "ClusterRole")}
    assert _grants(roles["dsv4-dsv4-operator"]) == EXPECTED_RULES
    assert _grants(roles["dsv4-dsv4-operator-crd-reader"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}
    }
    assert not by_kind(objects, "Role")
    for binding in by_kind(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "dsv4-dsv4-operator", "namespace": "dsv4-system"}
        ]


@needs_helm
def test_every_kind_the_operator_manages_is_granted() -> None:
    (role,) = [
        r for r in by_kind(render(), "ClusterRole") if r["metadata"]["name"] == "dsv4-dsv4-operator"
    ]
    grants = _grants(role)
    for api_version, kind in MANAGED_KINDS:
        group = api_version.rpartition("/")[0]
        plural = kind.lower().removesuffix("y") + ("ies" if kind.endswith("y") else "s")
        assert {"list", "create", "patch", "delete"} <= grants.get((group, plural), set()), kind


@needs_helm
def test_owner_references_that_block_deletion_are_granted(
    make_body: Callable[..., dict[str, Any]],
) -> None:
    """OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on a child needs
    update on the owner's finalizers subresource; without it every child apply is refused."""
    children = list(yaml.safe_load_all(render_cr(make_body("tiny-pd.yaml"))))
    blocking = {
        (ref["apiVersion"].rpartition("/")[0], ref["kind"])
        for child in children
        for ref in child["metadata"].get("ownerReferences", [])
        if ref.get("blockOwnerDeletion")
    }
    assert blocking == {("serving.dsv4.io", "DSV4Deployment")}
    for values in VALUE_SETS.values():
        objects = render(*values)
        for role in by_kind(objects, "ClusterRole") + by_kind(objects, "Role"):
            grants = _grants(role)
            if ("serving.dsv4.io", "dsv4deployments") in grants:
                assert "update" in grants.get(("serving.dsv4.io", "dsv4deployments/finalizers"), ())


@needs_helm
def test_every_statefulset_names_a_rendered_governing_service() -> None:
    """A StatefulSet's serviceName is the headless Service that gives its pods DNS names."""
    for values in VALUE_SETS.values():
        objects = render(*values)
        services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
        for sts in by_kind(objects, "StatefulSet"):
            service = services.get(sts["spec"]["serviceName"])
            assert service is not None, sts["spec"]["serviceName"]
            assert service["spec"].get("clusterIP") == "None"
            selector = service["spec"]["selector"]
            labels = sts["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items()


@needs_helm
def test_no_secret_is_listable_and_no_nodes_anywhere() -> None:
    """Secrets: `create` (each deployment's PD Secret, never read back) and `get` (the one an
    hf:// source's tokenSecretRef names, by name); never list, watch, change or delete one. No
    nodes, no RBAC objects."""
    for name in VALUE_SETS:
        for role in by_kind(render(*VALUE_SETS[name]), "ClusterRole") + by_kind(
            render(*VALUE_SETS[name]), "Role"
        ):
            grants = _grants(role)
            resources = {res for _, res in grants}
            assert not resources & {"nodes", "clusterroles", "roles", "rolebindings"}
            assert grants.get(("", "secrets"), {"get"}) <= {"create", "get"}


@needs_helm
@pytest.mark.parametrize(
    ("values", "namespaces"),
    [
        (["--set", "rbac.namespaced=true"], ["dsv4-system"]),
        (["--set", "watch.namespaces={team-a,team-b}"], ["team-a", "team-b"]),
        (["--set", "rbac.namespaced=true", "--set", "replicaCount=2"], ["dsv4-system"]),
    ],
)
def test_namespaced_mode_uses_roles_only(values: list[str], namespaces: list[str]) -> None:
    objects = render(*values)
    # No ClusterRole carries workload verbs; only the optional read-only CRD observer remains.
    for cluster_role in by_kind(objects, "ClusterRole"):
        assert set(_grants(cluster_role)) == {("apiextensions.k8s.io", "customresourcedefinitions")}
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces
    peered = "replicaCount=2" in values
    for role in roles:
        expected = dict(EXPECTED_RULES)
        if peered:
            expected[("zalando.org", "kopfpeerings")] = {"get", "list", "watch", "patch"}
        assert _grants(role) == expected
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == namespaces
    (sts,) = by_kind(objects, "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace=")] == [
        f"--namespace={n}" for n in namespaces
    ]
    assert "--all-namespaces" not in args
    env = {
        e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DSV4_NAMESPACED"] == "true"  # kopf lists no namespaces, which Roles forbid
    if peered:
        assert sorted(p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")) == (
            namespaces
        )
        assert not by_kind(objects, "ClusterKopfPeering")


@needs_helm
def test_cluster_wide_mode_lets_kopf_observe_namespaces() -> None:
    (sts,) = by_kind(render(), "StatefulSet")
    env = {
        e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DSV4_NAMESPACED"] == "false"


@needs_helm
def test_crd_observer_can_be_turned_off() -> None:
    objects = render("--set", "rbac.namespaced=true", "--set", "rbac.observeCRDs=false")
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


# --- CRD upgrades ----------------------------------------------------------------------------


@needs_helm
def test_crds_are_not_templated_by_default() -> None:
    assert not by_kind(render(), "CustomResourceDefinition")


@needs_helm
def test_managed_crds_render_the_same_schema_and_survive_uninstall() -> None:
    objects = render("--set", "crds.manage=true")
    crds = {c["metadata"]["name"]: c for c in by_kind(objects, "CustomResourceDefinition")}
    assert set(crds) == {
        "dsv4deployments.serving.dsv4.io",
        "dsv4rolescalers.serving.dsv4.io",
        "clusterkopfpeerings.zalando.org",
        "kopfpeerings.zalando.org",
    }
    source = S.load_yaml(CRD_FILE)
    ours = crds["dsv4deployments.serving.dsv4.io"]
    assert ours["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # Same spec, same types (helm's fromYaml/toYaml must not turn ints into floats; the
    # source's YAML anchors come out expanded).
    assert json.dumps(ours["spec"], sort_keys=True) == json.dumps(source["spec"], sort_keys=True)
    without_peering = render("--set", "crds.manage=true", "--set", "crds.managePeering=false")
    assert [
        c["metadata"]["name"] for c in by_kind(without_peering, "CustomResourceDefinition")
    ] == ["dsv4deployments.serving.dsv4.io", "dsv4rolescalers.serving.dsv4.io"]


@needs_helm
def test_notes_render() -> None:
    out = helm("install", "dsv4", str(CHART), "--dry-run=client", "--namespace", "dsv4-system")
    assert "kubectl apply --server-side -f crds/dsv4deployment.yaml" in out
