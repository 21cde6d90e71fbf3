"""Pure builders for the pod-bearing children: one StatefulSet per PP group (its pods are the
group's PP ranks) and the router Deployment, plus the hardened pod template they share. The
containers in them are the engine's (`flavors`).

NOTE: a PP group's StatefulSet uses `updateStrategy: OnDelete`. The operator replaces a group's
pods together (`groups.py`), so a group never runs mixed template versions and a role never
loses more than one group to a rollout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from dsv4_common.api.names import GPU_RESOURCE
from dsv4_common.api.rank_config import (
    API_KEY_DIR,
    MODEL_CONFIG_DIR,
    PD_SECRET_DIR,
    PD_SECRET_KEY,
)
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.core.units import GIB
from dsv4_common.plan.planner import Plan
from dsv4_common.plan.threads import torch_threads
from dsv4_operator import labels as L
from dsv4_operator.gang import pod_fields
from dsv4_operator.manifests import Obj, group_meta, router_meta
from dsv4_operator.placement import group_affinity
from dsv4_operator.quantities import quantity
from dsv4_operator.workerconfig import CONFIG_DIR, WORKER_PORTS

RUN_AS_USER: Final = 10001  # the images' non-root user (Dockerfile.worker)
# spec.apiKey's Secret key, mounted as API_KEY_DIR/API_KEY_FILE_NAME (the rank config's file),
# readable by the pod's group (fsGroup) only.
API_KEY_VOLUME: Final = "api-key"
API_KEY_FILE_NAME: Final = "api-key"
API_KEY_MODE: Final = 0o440
DEFAULT_WORKER_IMAGE: Final = "ghcr.io/dsv4-serve/worker:0.1.0"
# CPU mode: requests/limits for worker pods (the planner budgets CPU_MODE_MEMORY_BYTES of it).
CPU_MODE_REQUESTS: Final = {"cpu": "500m", "memory": "1536Mi"}
CPU_MODE_LIMITS: Final = {"memory": "2Gi"}
ROUTER_REQUESTS: Final = {"cpu": "100m", "memory": "256Mi"}
ROUTER_LIMITS: Final = {"memory": "1Gi"}
# Weight loading can take long on big checkpoints: the startup probe allows an hour.
STARTUP_PERIOD_S: Final = 10
STARTUP_FAILURES: Final = 360
# GPU pods request host memory for the weights they load (every GPU's shard of the largest PP
# rank of the role) plus a margin: 10% and 8 GiB for the runtime, and CPU for each GPU's
# process (its scheduler loop, kernel launches, NCCL and transfer threads). A user request or
# limit of either resource replaces its default.
WEIGHT_MEMORY_MARGIN: Final = 0.10
RUNTIME_MEMORY_BYTES: Final = 8 * GIB
CPU_PER_GPU: Final = 2


def _env_field(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def container_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def worker_resources(spec: DeploymentSpec) -> Obj:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if spec.gpu.cpu_mode:
        requests.update(CPU_MODE_REQUESTS)
        limits.update(CPU_MODE_LIMITS)
    requests.update(dict(spec.resources.requests))
    limits.update(dict(spec.resources.limits))
    if not spec.gpu.cpu_mode:
        limits[GPU_RESOURCE] = str(spec.gpu.per_pod)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def worker_cpu_request(spec: DeploymentSpec, role: L.WorkerRole) -> float | None:
    """The CPU request a role's worker container ends up with, as the pod template merge and
    Kubernetes' defaulting give it: the role podTemplate's worker container, then
    spec.resources, then the default (CPU_MODE_REQUESTS, or CPU_PER_GPU per GPU); at each level
    a request, else its limit (an unset request defaults to the limit). None: no request."""
    levels: list[Any] = []
    template = spec.role(role).pod_template or {}
    containers = (template.get("spec") or {}).get("containers") or []
    for c in containers if isinstance(containers, list) else []:
        if isinstance(c, dict) and c.get("name") == "worker":  # the main container (podtemplate)
            levels.append(c.get("resources"))
    levels.append(
        {"requests": dict(spec.resources.requests), "limits": dict(spec.resources.limits)}
    )
    default = CPU_MODE_REQUESTS["cpu"] if spec.gpu.cpu_mode else str(CPU_PER_GPU * spec.gpu.per_pod)
    levels.append({"requests": {"cpu": default}})
    for level in levels:
        for key in ("requests", "limits"):
            amounts = level.get(key) if isinstance(level, dict) else None
            cpu = quantity(amounts.get("cpu")) if isinstance(amounts, dict) else None
            if cpu is not None and cpu.is_finite() and cpu > 0:
                return float(cpu)
    return None


def worker_torch_threads(spec: DeploymentSpec) -> dict[L.WorkerRole, int | None]:
    """Each role's rank-config torch threads, from its workers' CPU request
    (`dsv4_common.plan.threads`); None without one: the worker decides from its cgroup."""
    out: dict[L.WorkerRole, int | None] = {}
    for role in L.WORKER_ROLES:
        cpus = worker_cpu_request(spec, role)
        out[role] = None if cpus is None else torch_threads(cpus)
    return out


def gpu_worker_requests(spec: DeploymentSpec, plan: Plan) -> dict[str, str]:
    """The default requests of a role's GPU worker pods, either engine (none in CPU mode, whose
    pods have CPU_MODE_REQUESTS): memory for the weights, CPU per GPU."""
    if spec.gpu.cpu_mode:
        return {}
    weights = max(r.weight_bytes for r in plan.ranks) * spec.gpu.per_pod
    need = weights * (1 + WEIGHT_MEMORY_MARGIN) + RUNTIME_MEMORY_BYTES
    return {"cpu": str(CPU_PER_GPU * spec.gpu.per_pod), "memory": f"{math.ceil(need / GIB)}Gi"}


def _volumes(
    meta: DeploymentMeta, spec: DeploymentSpec, tmp_limit: str
) -> tuple[list[Obj], list[Obj]]:
    shm_limit = "1Gi" if spec.gpu.cpu_mode else "32Gi"
    # The PD secret: the rank and router configs name its file (`pd_secret_file`).
    secret = {"secretName": L.pd_secret_name(meta.name), "defaultMode": 0o440}
    secret["items"] = [{"key": PD_SECRET_KEY, "path": PD_SECRET_KEY}]
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": L.config_name(meta.name)}},
        {"name": "pd-secret", "secret": secret},
        {"name": "tmp", "emptyDir": {"sizeLimit": tmp_limit}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_limit}},
    ]
    mounts: list[Obj] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "pd-secret", "mountPath": PD_SECRET_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    weights = spec.model.weights
    if weights is not None:
        volumes.append(
            {
                "name": "weights",
                "persistentVolumeClaim": {
                    "claimName": weights.persistent_volume_claim,
                    "readOnly": True,
                },
            }
        )
        mount: Obj = {"name": "weights", "mountPath": weights.path, "readOnly": True}
        if weights.sub_path:  # a pvc:// source's PATH inside its claim
            mount["subPath"] = weights.sub_path
        mounts.append(mount)
    if (ref := spec.model.config_map) is not None:
        # Only the referenced key, at `model_config_path(ref.name)`: the pods read the model's
        # config from this mount, never from the API (no service account token is mounted).
        item = {"key": ref.key, "path": f"{ref.name}/config.json"}
        volumes.append({"name": "model-config", "configMap": {"name": ref.name, "items": [item]}})
        mounts.append({"name": "model-config", "mountPath": MODEL_CONFIG_DIR, "readOnly": True})
    if (key := spec.api_key) is not None:
        # The kubelet mounts the key (the operator never reads the Secret); the pod waits
        # while the Secret or its key is missing, rather than serving without a key.
        item = {"key": key.key, "path": API_KEY_FILE_NAME}
        secret = {"secretName": key.name, "items": [item], "defaultMode": API_KEY_MODE}
        volumes.append({"name": API_KEY_VOLUME, "secret": secret})
        mounts.append({"name": API_KEY_VOLUME, "mountPath": API_KEY_DIR, "readOnly": True})
    return volumes, mounts


def _pod_spec(
    meta: DeploymentMeta, spec: DeploymentSpec, container: Obj, *, gpu: bool, tmp_limit: str
) -> Obj:
    volumes, mounts = _volumes(meta, spec, tmp_limit)
    pod: Obj = {
        "serviceAccountName": L.service_account_name(meta.name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": 60,
        "containers": [{**container, "volumeMounts": mounts}],
        "volumes": volumes,
    }
    if gpu:
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return pod


def worker_env(meta: DeploymentMeta, role: L.WorkerRole) -> list[Obj]:
    """What every worker container is told about itself (either engine)."""
    return [
        {"name": "DSV4_DEPLOYMENT", "value": meta.name},
        {"name": "DSV4_ROLE", "value": role},
        {"name": "DSV4_CONFIG_DIR", "value": CONFIG_DIR},
        {"name": "HOME", "value": "/tmp"},
        _env_field("DSV4_GROUP", f"metadata.labels['{L.GROUP_LABEL}']"),
        _env_field("DSV4_PP_RANK", f"metadata.labels['{L.POD_INDEX_LABEL}']"),
        _env_field("DSV4_POD_NAME", "metadata.name"),
        _env_field("DSV4_NAMESPACE", "metadata.namespace"),
        _env_field("DSV4_POD_IP", "status.podIP"),
    ]


def worker_ports() -> list[Obj]:
    """Named worker ports (the Services and the NetworkPolicy refer to the names)."""
    return [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in WORKER_PORTS.items()]


def worker_pod_template(
    meta: DeploymentMeta,
    spec: DeploymentSpec,
    role: L.WorkerRole,
    replica: int,
    container: Obj,
    *,
    tmp_limit: str,
    engine_labels: Mapping[str, str],
    model_config_hash: str | None = None,
) -> Obj:
    """The template of one group's pods, without the template-hash annotation. The hash of a
    configMapRef model's config.json is an annotation: editing that ConfigMap changes the
    template, so the group rolls. `container`, `tmp_limit` and `engine_labels` (after the
    group's labels) come from the engine's flavor (`flavors`)."""
    pod = _pod_spec(meta, spec, container, gpu=not spec.gpu.cpu_mode, tmp_limit=tmp_limit)
    metadata: Obj = {"labels": L.group_labels(meta.name, role, replica)}
    metadata["labels"].update(engine_labels)
    gang = pod_fields(spec.scheduling.gang, L.group_name(meta.name, role, replica))
    metadata["labels"].update(gang.labels)
    annotations = dict(gang.annotations)
    if model_config_hash is not None:
        annotations[L.MODEL_CONFIG_HASH_ANNOTATION] = model_config_hash
    if annotations:
        metadata["annotations"] = annotations
    if gang.scheduler_name is not None:
        pod["schedulerName"] = gang.scheduler_name
    if (affinity := group_affinity(meta.name, spec.scheduling, role, replica)) is not None:
        pod["affinity"] = affinity
    return {"metadata": metadata, "spec": pod}


def build_group_statefulset(
    meta: DeploymentMeta,
    spec: DeploymentSpec,
    role: L.WorkerRole,
    replica: int,
    template: Obj,
) -> Obj:
    group = L.group_name(meta.name, role, replica)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _with_workload_labels(group_meta(meta, role, replica), template),
        "spec": {
            "replicas": spec.role(role).pipeline_parallel,
            "serviceName": group,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": L.group_selector(meta.name, group)},
            "template": template,
        },
    }


def router_pod_template(
    meta: DeploymentMeta, spec: DeploymentSpec, container: Obj, *, tmp_limit: str
) -> Obj:
    """The router's pod template around the engine's `router` container (`flavors`)."""
    pod = _pod_spec(meta, spec, container, gpu=False, tmp_limit=tmp_limit)
    # The router needs the config, the PD secret (and the API key) only: no weights, little
    # shared memory.
    kept = ("config", "pd-secret", "tmp", API_KEY_VOLUME)
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] in kept]
    pod["containers"][0]["volumeMounts"] = [
        m for m in pod["containers"][0]["volumeMounts"] if m["name"] in kept
    ]
    return {"metadata": {"labels": L.component_labels(meta.name, "router")}, "spec": pod}


def build_router_deployment(meta: DeploymentMeta, spec: DeploymentSpec, template: Obj) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _with_workload_labels(router_meta(meta), template),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": L.component_selector(meta.name, "router")},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": template,
        },
    }


def _with_workload_labels(metadata: Obj, template: Obj) -> Obj:
    """Kueue reads its labels (queue, priority) from the workload object, not its pods: those
    the pod template carries are copied onto the StatefulSet or Deployment."""
    labels = template["metadata"].get("labels", {})
    for key in L.KUEUE_WORKLOAD_LABELS:
        if key in labels:
            metadata["labels"][key] = labels[key]
    return metadata


def with_template_hash(template: Obj, template_hash: str) -> Obj:
    """A copy of `template` whose pods carry the hash (a change replaces the pods)."""
    metadata: dict[str, Any] = dict(template["metadata"])
    metadata["annotations"] = {
        **metadata.get("annotations", {}),
        L.TEMPLATE_HASH_ANNOTATION: template_hash,
    }
    return {**template, "metadata": metadata}
