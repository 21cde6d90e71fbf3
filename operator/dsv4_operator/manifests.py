"""Pure builders for the non-workload children: Services, ConfigMap, PodDisruptionBudget,
NetworkPolicy, ServiceAccount. One function per kind; explicit arguments in, a plain dict out.

The pod-bearing kinds (StatefulSet, Deployment) live in `workloads.py`.
"""

from __future__ import annotations

from typing import Any, Final

from dsv4_common.api.rank_config import PD_SECRET_KEY
from dsv4_common.api.spec import DeploymentMeta
from dsv4_operator import labels as L
from dsv4_operator.workerconfig import HTTP_PORT, STATUS_PORT, WORKER_PORTS

Obj = dict[str, Any]
# Where the chart installs the operator (its README's namespace): the NetworkPolicies' default
# when the operator's own namespace is not known (`dsv4 render`).
DEFAULT_OPERATOR_NAMESPACE: Final = "dsv4-system"


def owner_reference(meta: DeploymentMeta) -> Obj:
    assert meta.uid is not None, "owner references need the CR's uid"
    return {
        "apiVersion": L.API_VERSION,
        "kind": L.KIND,
        "name": meta.name,
        "uid": meta.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(meta: DeploymentMeta, name: str, labels: dict[str, str]) -> Obj:
    """Child metadata: namespace, labels and (when the CR exists) the owner reference."""
    out: Obj = {"name": name, "namespace": meta.namespace, "labels": dict(labels)}
    if meta.uid is not None:
        out["ownerReferences"] = [owner_reference(meta)]
    return out


def group_meta(meta: DeploymentMeta, role: L.WorkerRole, replica: int) -> Obj:
    """Metadata of a PP group's StatefulSet and headless Service (they share the name)."""
    group = L.group_name(meta.name, role, replica)
    return object_meta(meta, group, L.group_labels(meta.name, role, replica))


def role_meta(meta: DeploymentMeta, role: L.WorkerRole) -> Obj:
    """Metadata of a role's routing Service and PodDisruptionBudget (they share the name)."""
    return object_meta(meta, L.role_service_name(meta.name, role), L.role_labels(meta.name, role))


def router_meta(meta: DeploymentMeta) -> Obj:
    """Metadata of the router's Deployment and Service (they share the name)."""
    return object_meta(meta, L.router_name(meta.name), L.component_labels(meta.name, "router"))


def _ports(names: tuple[str, ...]) -> list[Obj]:
    return [{"name": n, "port": WORKER_PORTS[n], "targetPort": n, "protocol": "TCP"} for n in names]


def build_pd_secret(meta: DeploymentMeta, value: str) -> Obj:
    """The deployment's PD secret (`value`: random, made once by the reconciler; never
    re-applied, so it does not change while pods use it). Its pods mount it at
    PD_SECRET_DIR; it authenticates their PD channels and the router's choice of prefill."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(meta, L.pd_secret_name(meta.name), L.owned_labels(meta.name)),
        "type": "Opaque",
        "stringData": {PD_SECRET_KEY: value},
    }


def build_service_account(meta: DeploymentMeta) -> Obj:
    """Workers and the router call no Kubernetes API: no token is mounted, no role is bound."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(meta, L.service_account_name(meta.name), L.owned_labels(meta.name)),
        "automountServiceAccountToken": False,
    }


def build_config_map(meta: DeploymentMeta, data: dict[str, str]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(meta, L.config_name(meta.name), L.owned_labels(meta.name)),
        "data": dict(data),
    }


def build_group_service(meta: DeploymentMeta, role: L.WorkerRole, replica: int) -> Obj:
    """Headless Service of one PP group: stable DNS per rank, published before readiness so
    that ranks can find each other while the group forms."""
    group = L.group_name(meta.name, role, replica)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": group_meta(meta, role, replica),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": L.group_selector(meta.name, group),
            "ports": _ports(("pp", "kv", "status")),
        },
    }


def build_role_service(meta: DeploymentMeta, role: L.WorkerRole) -> Obj:
    """Headless routing Service of a role: its endpoints are the Ready serving ranks only
    (PP rank 0 of each group, selected by the StatefulSet's pod-index label). Unready
    addresses are not published: the default, left unset because the API server stores no
    `publishNotReadyAddresses: false` (an omitempty bool), and a planned field the live
    object lacks would be re-applied on every reconcile."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": role_meta(meta, role),
        "spec": {
            "clusterIP": "None",
            "selector": L.serving_selector(meta.name, role),
            "ports": _ports(("http", "kv")),
        },
    }


def build_router_service(meta: DeploymentMeta, port: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": router_meta(meta),
        "spec": {
            "type": "ClusterIP",
            "selector": L.component_selector(meta.name, "router"),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_pdb(meta: DeploymentMeta, role: L.WorkerRole) -> Obj:
    """At most one worker pod of a role voluntarily disrupted at a time. Because a serving
    rank turns unready when a peer is gone, one evicted pod blocks further evictions."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": role_meta(meta, role),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": L.role_selector(meta.name, role)},
        },
    }


def metrics_ingress(scrape_namespace: str, *, port: str = "status") -> list[Obj]:
    """Every pod of `scrape_namespace` (Prometheus) on the port serving /metrics, by name
    (the engine flavor's `observed_port` on workers, `status` on the router); no rule when
    it is empty."""
    if not scrape_namespace:
        return []
    return [
        {
            "from": [
                {"namespaceSelector": {"matchLabels": {L.NAMESPACE_NAME_LABEL: scrape_namespace}}}
            ],
            "ports": [{"protocol": "TCP", "port": port}],
        }
    ]


def operator_ingress(port: int | str, operator_namespace: str) -> Obj:
    """The operator's pods, in the operator's own namespace only, on `port`. (The pod label
    alone would admit any pod that carries it; only a cluster admin places pods there.)"""
    namespace = {"matchLabels": {L.NAMESPACE_NAME_LABEL: operator_namespace}}
    pods = {"matchLabels": dict(L.OPERATOR_POD_LABELS)}
    return {
        "from": [{"namespaceSelector": namespace, "podSelector": pods}],
        "ports": [{"protocol": "TCP", "port": port}],
    }


def build_network_policy(
    meta: DeploymentMeta,
    scrape_namespace: str = "",
    *,
    observed_port: str = "status",
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
) -> Obj:
    """Worker ingress: peer workers of this deployment on any port (PP activations and KV
    transfer; UCX/NIXL data paths use ephemeral ports), the router on the serving and status
    ports, the operator (from its namespace) on the port it observes and, when given, the metrics
    scrapers' namespace (`metrics_ingress`). Everything else is denied. The operator and the
    scrapers get `observed_port` (a worker port name, the engine flavor's: `status`, 8081, on
    every rank of our worker; `http`, 8080, on PP rank 0 of SGLang's)."""
    workers = L.component_selector(meta.name, "worker")
    router = L.component_selector(meta.name, "router")
    observed_number = WORKER_PORTS[observed_port]
    return _ingress_policy(
        meta,
        L.network_policy_name(meta.name),
        "worker",
        [
            {"from": [{"podSelector": {"matchLabels": workers}}]},
            {
                "from": [{"podSelector": {"matchLabels": router}}],
                "ports": [
                    {"protocol": "TCP", "port": HTTP_PORT},
                    {"protocol": "TCP", "port": STATUS_PORT},
                ],
            },
            operator_ingress(observed_number, operator_namespace),
            *metrics_ingress(scrape_namespace, port=observed_port),
        ],
    )


def build_router_network_policy(
    meta: DeploymentMeta,
    scrape_namespace: str = "",
    *,
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
) -> Obj:
    """Router ingress: clients from anywhere on the serving port (`http`), the operator (from
    its namespace) and the metrics scrapers' namespace (when given) on `status` (/status,
    /metrics). Everything else is denied."""
    return _ingress_policy(
        meta,
        L.router_network_policy_name(meta.name),
        "router",
        [
            {"ports": [{"protocol": "TCP", "port": "http"}]},
            operator_ingress("status", operator_namespace),
            *metrics_ingress(scrape_namespace),  # the router's /metrics is on `status`
        ],
    )


def _ingress_policy(
    meta: DeploymentMeta, name: str, component: L.Component, rules: list[Obj]
) -> Obj:
    """A NetworkPolicy admitting only `rules` into the pods of `component`."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(meta, name, L.component_labels(meta.name, component)),
        "spec": {
            "podSelector": {"matchLabels": L.component_selector(meta.name, component)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }
