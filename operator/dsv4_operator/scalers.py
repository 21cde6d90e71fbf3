"""Autoscaling by an HPA or KEDA instead of the operator (`spec.autoscaling.engine: hpa|keda`),
pure. Per autoscaled role the operator renders:

    DSV4RoleScaler <name>-<role>   serving.dsv4.io/v1alpha1, with the scale subresource the
                                   HPA needs (spec.replicas; status.replicas, status.selector)
    HorizontalPodAutoscaler        autoscaling/v2, on the role's pods' custom metrics (a metrics
      (engine hpa)                 adapter serves them from Prometheus: docs/operator.md)
    ScaledObject (engine keda)     keda.sh/v1alpha1, Prometheus triggers at prometheusAddress

Both aim at the role's DSV4RoleScaler; what they write to its spec.replicas is the number of PP
groups the operator runs for the role (`external_spec`), clamped to the role's range. The
operator echoes that figure back in its own apply of the scaler, so the two writers agree
(server-side apply: the HPA's update shares ownership of spec.replicas; DGDSA/RBGSA's pattern).
The band and maxSkew are the operator engine's: the parser refuses them with these engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from dsv4_common.api.autoscaling_spec import RoleAutoscaling
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.scaling import with_replicas
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj, object_meta

SCALER_KIND: Final = "DSV4RoleScaler"
SCALER_API_VERSION: Final = L.API_VERSION
HPA_API_VERSION: Final = "autoscaling/v2"
KEDA_API_VERSION: Final = "keda.sh/v1alpha1"
SCALER_KINDS: Final = (
    (SCALER_API_VERSION, SCALER_KIND),
    (HPA_API_VERSION, "HorizontalPodAutoscaler"),
    (KEDA_API_VERSION, "ScaledObject"),
)
# Served only where installed: KEDA's, ours where the chart's second CRD is, and the HPA (every
# cluster since 1.23; not this repository's fake API server). A cluster that does not serve one
# holds none of ours: the pruner skips it.
OPTIONAL_SCALER_KINDS: Final = frozenset(SCALER_KINDS)
SCALER_TEMPLATE: Final = "{name}-{role}"
# The workers' metrics the HPA's Pods metrics and KEDA's triggers read (the chart's PodMonitor
# labels them with the pod's deployment and role).
QUEUE_METRIC: Final = "dsv4_queue_depth_requests"
KV_METRIC: Final = "vllm:kv_cache_usage_perc"  # the binding pool's fraction
KV_METRIC_ADAPTED: Final = "vllm_kv_cache_usage_perc"  # as a metrics adapter names it


def scaler_name(name: str, role: WorkerRole) -> str:
    return SCALER_TEMPLATE.format(name=name, role=role)


def external(spec: DeploymentSpec) -> bool:
    return spec.autoscaling.engine != "operator"


def external_roles(spec: DeploymentSpec) -> dict[WorkerRole, RoleAutoscaling]:
    if not external(spec):
        return {}
    return {r: a for r in WORKER_ROLES if (a := spec.role(r).autoscaling) is not None}


def external_spec(
    spec: DeploymentSpec, live: Mapping[WorkerRole, Mapping[str, Any] | None]
) -> DeploymentSpec:
    """The spec with each externally scaled role at its scaler's spec.replicas (clamped to
    the role's range); a scaler not created yet: the role's replicas, clamped."""
    out = spec
    for role, auto in external_roles(spec).items():
        scaler = live.get(role) or {}
        wanted = (scaler.get("spec") or {}).get("replicas")
        base = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) else None
        out = with_replicas(
            out, role, auto.clamp(base if base is not None else spec.role(role).replicas)
        )
    return out


def build_scaling_objects(meta: DeploymentMeta, spec: DeploymentSpec) -> list[Obj]:
    """Every role's scaler and its HPA or ScaledObject (`spec` with the replicas it runs)."""
    out: list[Obj] = []
    for role, auto in external_roles(spec).items():
        out.append(build_role_scaler(meta, role, auto, spec.role(role).replicas))
        if spec.autoscaling.engine == "hpa":
            out.append(build_hpa(meta, role, auto))
        else:
            assert spec.autoscaling.prometheus_address is not None, "the parser requires it"
            out.append(build_scaled_object(meta, role, auto, spec.autoscaling.prometheus_address))
    return out


def build_role_scaler(
    meta: DeploymentMeta, role: WorkerRole, auto: RoleAutoscaling, replicas: int
) -> Obj:
    return {
        "apiVersion": SCALER_API_VERSION,
        "kind": SCALER_KIND,
        "metadata": object_meta(meta, scaler_name(meta.name, role), L.role_labels(meta.name, role)),
        "spec": {
            "deployment": meta.name,
            "role": role,
            "replicas": replicas,
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
        },
        "status": {
            "replicas": replicas,
            "selector": L.selector_string(L.serving_selector(meta.name, role)),
        },
    }


def _target(meta: DeploymentMeta, role: WorkerRole) -> Obj:
    return {
        "apiVersion": SCALER_API_VERSION,
        "kind": SCALER_KIND,
        "name": scaler_name(meta.name, role),
    }


def _behavior(auto: RoleAutoscaling) -> Obj:
    """The window and the cooldown as the HPA says them: a scale-down takes the highest
    recommendation of the window; at most one group per cooldown either way."""
    period = max(1, auto.cooldown_s)
    return {
        "scaleDown": {
            "stabilizationWindowSeconds": auto.stabilization_s,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}],
        },
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}],
        },
    }


def build_hpa(meta: DeploymentMeta, role: WorkerRole, auto: RoleAutoscaling) -> Obj:
    """Pods metrics of the role's serving pods (the scaler's selector): a custom metrics adapter
    serves the workers' queue depth and binding-pool utilisation from Prometheus."""
    t = auto.targets
    metrics: list[Obj] = []
    if t.queue_depth_per_replica is not None:
        metrics.append(_pods_metric(QUEUE_METRIC, str(t.queue_depth_per_replica)))
    if t.kv_utilization is not None:
        metrics.append(_pods_metric(KV_METRIC_ADAPTED, f"{round(t.kv_utilization * 1000)}m"))
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(meta, scaler_name(meta.name, role), L.role_labels(meta.name, role)),
        "spec": {
            "scaleTargetRef": _target(meta, role),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(auto),
        },
    }


def _pods_metric(name: str, average: str) -> Obj:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": average},
        },
    }


def build_scaled_object(
    meta: DeploymentMeta, role: WorkerRole, auto: RoleAutoscaling, prometheus: str
) -> Obj:
    t = auto.targets
    labels = f'namespace="{meta.namespace}",deployment="{meta.name}",role="{role}"'
    triggers: list[Obj] = []
    if t.queue_depth_per_replica is not None:
        triggers.append(
            _prometheus_trigger(
                prometheus, f"sum({QUEUE_METRIC}{{{labels}}})", t.queue_depth_per_replica
            )
        )
    if t.kv_utilization is not None:
        # The mean over the role's serving ranks x groups: a target per group (AverageValue).
        query = f'sum({{__name__="{KV_METRIC}",{labels}}})'
        triggers.append(_prometheus_trigger(prometheus, query, t.kv_utilization))
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": object_meta(meta, scaler_name(meta.name, role), L.role_labels(meta.name, role)),
        "spec": {
            "scaleTargetRef": _target(meta, role),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "cooldownPeriod": max(1, auto.stabilization_s),
            "pollingInterval": 15,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(auto)}},
            "triggers": triggers,
        },
    }


def _prometheus_trigger(address: str, query: str, threshold: float) -> Obj:
    return {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {"serverAddress": address, "query": query, "threshold": f"{threshold:g}"},
    }
