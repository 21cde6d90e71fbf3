"""Desired state: spec + metadata + memory plan -> every child object, in apply order, plus the
selector that finds children to prune. Pure; `render.py` prints it, `reconcile.py` applies it.

Each object carries an applied-hash annotation (a hash of the object as planned) so the
reconciler can skip objects the cluster already holds; each pod template carries a
template-hash annotation (template + the config it reads) so a change rolls its pods.
A role's `podTemplate` is merged into its pod templates (`podtemplate.py`); what it may not set
raises `SpecError`, naming the field. What differs between engines (images, containers, the
checks beyond the CRD, a router that lists the groups that exist) comes from the spec's
`EngineFlavor` (`flavors`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.model_source import LocalSource
from dsv4_common.api.object_rules import MAX_OBJECT_BYTES
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, PodTemplate, SpecError
from dsv4_operator import labels as L
from dsv4_operator.flavors import flavor_of
from dsv4_operator.gang import POD_GROUP_KINDS, build_pod_group
from dsv4_operator.gie import GIE_KINDS, build_gateway_objects
from dsv4_operator.manifests import (
    DEFAULT_OPERATOR_NAMESPACE,
    Obj,
    build_config_map,
    build_group_service,
    build_network_policy,
    build_pdb,
    build_role_service,
    build_router_network_policy,
    build_router_service,
    build_service_account,
)
from dsv4_operator.pod_security import DEFAULT_LEVEL, Level
from dsv4_operator.podtemplate import merge_pod_template
from dsv4_operator.scalers import OPTIONAL_SCALER_KINDS, SCALER_KINDS, build_scaling_objects
from dsv4_operator.workerconfig import ROUTER_CONFIG_KEY, config_data, role_config_data
from dsv4_operator.workloads import (
    DEFAULT_WORKER_IMAGE,
    build_group_statefulset,
    build_router_deployment,
    gpu_worker_requests,
    router_pod_template,
    with_template_hash,
    worker_pod_template,
    worker_torch_threads,
)

ObjKey = tuple[str, str, str]  # (apiVersion, kind, name)

# Every kind the operator creates (the pruner lists exactly these).
MANAGED_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ServiceAccount"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "Deployment"),
    *POD_GROUP_KINDS,
    *GIE_KINDS,
    *SCALER_KINDS,
)
# Kinds served only where their add-on is installed: a cluster that does not serve one holds
# none of ours (the pruner skips it).
OPTIONAL_KINDS: frozenset[tuple[str, str]] = frozenset(
    (*POD_GROUP_KINDS, *GIE_KINDS, *OPTIONAL_SCALER_KINDS)
)


@dataclass(frozen=True, slots=True)
class SurgeGroup:
    """The objects of a surge group a roll may add: the `slot`-th after the role's replicas."""

    role: L.WorkerRole
    slot: int
    objects: tuple[Obj, ...]  # its PodGroup (if any), headless Service, StatefulSet


@dataclass(frozen=True, slots=True)
class DesiredState:
    objects: tuple[Obj, ...]  # the steady state: no surge group
    prune_selector: str
    # Group name (or the router Deployment's name) -> the template hash its pods must carry;
    # surge groups a roll could add included.
    template_hashes: dict[str, str]
    surge_groups: tuple[SurgeGroup, ...] = ()
    # A router that lists the groups that exist (`EngineFlavor.router_lists_groups`): a roll's
    # surge groups change its Deployment (it rolls to the new list); None where the router
    # finds groups itself.
    router_with_surge: Callable[[Mapping[L.WorkerRole, int]], Obj] | None = None

    def keys(self) -> set[ObjKey]:
        return {object_key(o) for o in self.objects}

    def with_surge(self, surge: Mapping[L.WorkerRole, int]) -> DesiredState:
        """This state plus the first `surge[role]` surge groups of each role."""
        extra = [o for g in self.surge_groups if g.slot < surge.get(g.role, 0) for o in g.objects]
        objects = (*self.objects, *extra)
        if self.router_with_surge is not None and any(surge.values()):
            router = self.router_with_surge(surge)
            objects = tuple(router if object_key(o) == object_key(router) else o for o in objects)
        return replace(self, objects=objects)


def object_key(obj: dict[str, Any]) -> ObjKey:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


def stable_hash(*parts: object) -> str:
    """16 hex digits of SHA-256 over canonical JSON."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stamp_applied_hash(obj: Obj) -> Obj:
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations.pop(L.APPLIED_HASH_ANNOTATION, None)
    annotations[L.APPLIED_HASH_ANNOTATION] = stable_hash(obj)
    return obj


def source_errors(spec: DeploymentSpec) -> list[str]:
    """What a cluster cannot run of `spec.model.source`: a local path."""
    if isinstance(spec.model.origin, LocalSource):
        return [
            "spec.model.source: a local path is read by dsv4 up only; in a cluster use "
            "hf://ORG/NAME[@REVISION] or pvc://CLAIM[/PATH]"
        ]
    return []


def stamped(obj: Obj) -> Obj:
    """`obj` with its applied-hash annotation (what `diff.needs_apply` compares)."""
    return _stamp_applied_hash(obj)


def build_desired_state(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    memory: MemoryPlan,
    *,
    default_image: str = DEFAULT_WORKER_IMAGE,
    metrics_scrape_namespace: str = "",
    model_config_hash: str | None = None,  # of a configMapRef's config.json: rolls workers
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
    pod_security: Level = DEFAULT_LEVEL,
) -> DesiredState:
    """`operator_namespace`: where the NetworkPolicies admit the operator from;
    `pod_security`: the level the podTemplates' containers and volumes are held to."""
    flavor = flavor_of(spec)
    image = flavor.worker_image(spec, default_image)
    data = config_data(spec, meta, memory, worker_torch_threads(spec))
    objects: list[Obj] = [
        build_service_account(meta),
        build_config_map(meta, data),
        build_network_policy(
            meta,
            metrics_scrape_namespace,
            observed_port=flavor.observed_port,
            operator_namespace=operator_namespace,
        ),
        build_router_network_policy(
            meta, metrics_scrape_namespace, operator_namespace=operator_namespace
        ),
    ]
    hashes: dict[str, str] = {}
    workloads: list[Obj] = []
    surge_groups: list[SurgeGroup] = []
    errors: list[str] = flavor.spec_errors(spec, meta, memory) + source_errors(spec)

    def merged(base: Obj, user: PodTemplate | None, role: str, **defaults: str) -> Obj:
        """The base template with the role's podTemplate merged in (errors collected)."""
        main: L.Component = "router" if role == "router" else "worker"
        try:
            template = merge_pod_template(
                base,
                user,
                path=f"spec.{role}.podTemplate",
                main=main,
                default_requests=defaults,
                args_refused=flavor.args_refused(main),
                pod_security=pod_security,
            )
        except SpecError as exc:
            errors.extend(e for e in exc.errors if e not in errors)
            return base
        size = len(json.dumps(template).encode())
        if size > MAX_OBJECT_BYTES and not any(e.startswith(f"spec.{role}.") for e in errors):
            errors.append(
                f"spec.{role}.podTemplate: the pod template would be {size} bytes; a workload "
                f"past {MAX_OBJECT_BYTES} bytes is never stored (etcd's request limit)"
            )
        return template

    for role in L.WORKER_ROLES:
        objects.append(build_role_service(meta, role))
        objects.append(build_pdb(meta, role))
        role_data = role_config_data(data, role)
        defaults = gpu_worker_requests(spec, memory.role(role))
        replicas = spec.role(role).replicas
        for replica in range(replicas + spec.role(role).rollout.max_surge):
            group = L.group_name(meta.name, role, replica)
            base = worker_pod_template(
                meta,
                spec,
                role,
                replica,
                flavor.worker_container(meta, spec, memory, role, replica, image),
                tmp_limit=flavor.tmp_limit,
                engine_labels=flavor.worker_pod_labels(spec),
                model_config_hash=model_config_hash,
            )
            template = merged(base, spec.role(role).pod_template, role, **defaults)
            hashes[group] = stable_hash(template, role_data)
            group_objects: list[Obj] = []
            if (pod_group := build_pod_group(meta, spec, role, replica, template)) is not None:
                group_objects.append(pod_group)  # before its pods: they name it
            group_objects.append(build_group_service(meta, role, replica))
            statefulset = build_group_statefulset(
                meta, spec, role, replica, with_template_hash(template, hashes[group])
            )
            if replica < replicas:
                objects.extend(group_objects)
                workloads.append(statefulset)
            else:
                stamped = tuple(_stamp_applied_hash(o) for o in (*group_objects, statefulset))
                surge_groups.append(SurgeGroup(role, replica - replicas, stamped))
    router_image = flavor.router_image(spec, image)

    def router_deployment(surge: Mapping[L.WorkerRole, int]) -> tuple[Obj, str]:
        """The router Deployment and its template hash (for `surge` where the router lists
        the groups)."""
        container = flavor.router_container(meta, spec, router_image, surge)
        base = router_pod_template(meta, spec, container, tmp_limit=flavor.tmp_limit)
        template = merged(base, spec.router.pod_template, "router")
        template_hash = stable_hash(template, data[ROUTER_CONFIG_KEY])
        deployment = build_router_deployment(
            meta, spec, with_template_hash(template, template_hash)
        )
        return deployment, template_hash

    router, hashes[L.router_name(meta.name)] = router_deployment({})
    if errors:
        raise SpecError(errors)
    objects.append(build_router_service(meta, spec.router.port))
    objects.extend(build_gateway_objects(meta, spec.gateway))  # the Inference Extension's
    objects.extend(build_scaling_objects(meta, spec))  # an HPA's or KEDA's targets
    workloads.append(router)
    objects.extend(workloads)  # last: everything they mount or join exists first
    return DesiredState(
        objects=tuple(_stamp_applied_hash(o) for o in objects),
        prune_selector=L.prune_selector(meta.name),
        template_hashes=hashes,
        surge_groups=tuple(surge_groups),
        router_with_surge=(
            (lambda surge: _stamp_applied_hash(router_deployment(surge)[0]))
            if flavor.router_lists_groups
            else None
        ),
    )
