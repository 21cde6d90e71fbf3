"""The deployment's config ConfigMap: the rank-config and router-config documents (built by
`dsv4_common.api.rank_config` with Kubernetes DNS names for addresses) and the whole plan for
humans.

A worker reads `{role}-rank-{DSV4_PP_RANK}.json` from CONFIG_DIR, the router `router.json`;
`plan.json` is the `dsv4 plan --json` report of both roles (not a contract). Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.rank_config import (
    API_KEY_FILE,
    CONFIG_DIR,
    DEFAULT_PORTS,
    PD_SECRET_PATH,
    ROUTER_CONFIG_KEY,
    RoleEndpoint,
    build_rank_config,
    build_router_config,
    rank_config_key,
    rank_config_to_dict,
    router_config_to_dict,
)
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.plan.report import plan_to_dict
from dsv4_operator.labels import WORKER_ROLES, WorkerRole, role_service_name

__all__ = ["CONFIG_DIR", "PLAN_KEY", "ROUTER_CONFIG_KEY", "WORKER_PORTS", "config_data"]

PLAN_KEY: Final = "plan.json"
# Worker ports by name (Services and the NetworkPolicy refer to the names).
WORKER_PORTS: Final = DEFAULT_PORTS.by_name()
HTTP_PORT: Final = DEFAULT_PORTS.http
STATUS_PORT: Final = DEFAULT_PORTS.status


def _service_host(meta: DeploymentMeta, role: WorkerRole) -> str:
    return f"{role_service_name(meta.name, role)}.{meta.namespace}.svc"


def rank_config(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    memory: MemoryPlan,
    role: WorkerRole,
    pp_rank: int,
    torch_threads: int | None = None,
) -> dict[str, Any]:
    config = build_rank_config(
        spec,
        meta,
        memory,
        role,
        pp_rank,
        # Ranks of one group resolve through the group's headless Service.
        peers_host_template="{group}-{rank}.{group}." + f"{meta.namespace}.svc",
        role_services={r: _service_host(meta, r) for r in WORKER_ROLES},
        torch_threads=torch_threads,
        api_key_file=api_key_file(spec),
        pd_secret_file=PD_SECRET_PATH,  # the mounted PD Secret
    )
    return rank_config_to_dict(config)


def api_key_file(spec: DeploymentSpec) -> str | None:
    """Where the pods read the API key (`workloads` mounts the Secret there); None: no key."""
    return API_KEY_FILE if spec.api_key is not None else None


def router_config(spec: DeploymentSpec, meta: DeploymentMeta) -> dict[str, Any]:
    # Headless Services whose endpoints are the ready serving ranks (PP rank 0) only.
    endpoints = {
        r: RoleEndpoint(
            service=_service_host(meta, r), port=DEFAULT_PORTS.http, bootstrap_port=DEFAULT_PORTS.kv
        )
        for r in WORKER_ROLES
    }
    config = build_router_config(
        spec, meta, endpoints, api_key_file=api_key_file(spec), pd_secret_file=PD_SECRET_PATH
    )
    return router_config_to_dict(config)


def _dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def config_data(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    memory: MemoryPlan,
    torch_threads: Mapping[WorkerRole, int | None] | None = None,
) -> dict[str, str]:
    """ConfigMap data: one document per (role, PP rank), the router's, and the whole plan.
    `torch_threads`: each role's rank-config value (`workloads.worker_torch_threads`)."""
    data: dict[str, str] = {}
    for role in WORKER_ROLES:
        threads = (torch_threads or {}).get(role)
        for rank in range(spec.role(role).pipeline_parallel):
            doc = rank_config(spec, meta, memory, role, rank, threads)
            data[rank_config_key(role, rank)] = _dump(doc)
    data[ROUTER_CONFIG_KEY] = _dump(router_config(spec, meta))
    data[PLAN_KEY] = _dump({role: plan_to_dict(memory.role(role)) for role in WORKER_ROLES})
    return data


def role_config_data(data: dict[str, str], role: WorkerRole) -> dict[str, str]:
    """The part of the ConfigMap a role's pods read (its pod-template hash covers it)."""
    return {k: v for k, v in data.items() if k.startswith(f"{role}-rank-")}
