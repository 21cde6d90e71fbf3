"""What each worker and the router are told: per-rank JSON documents for the config ConfigMap.

The contract with `dsv4 serve` (worker side): the ConfigMap is mounted at CONFIG_DIR; a worker
reads `{role}-rank-{DSV4_PP_RANK}.json`, the router reads `router.json`; `plan.json` is for
humans. Keys inside the documents are snake_case (Python side). Pure.
"""

from __future__ import annotations

import json
from typing import Any, Final

from dsv4_operator.labels import (
    SERVING_RANK,
    WORKER_ROLES,
    WorkerRole,
    role_service_name,
)
from dsv4_operator.memory import MemoryPlan
from dsv4_operator.spec import DeploymentMeta, DeploymentSpec
from dsv4_worker.plan.report import plan_to_dict, rank_to_dict

CONFIG_VERSION: Final = 1
CONFIG_DIR: Final = "/etc/dsv4"
ROUTER_CONFIG_KEY: Final = "router.json"
PLAN_KEY: Final = "plan.json"

# Worker ports (names are what Services and the NetworkPolicy refer to).
HTTP_PORT: Final = 8080  # serving API (rank 0 of a group answers the router)
STATUS_PORT: Final = 8081  # /live, /ready, /status (realized capacity), /metrics
PP_PORT: Final = 8082  # pipeline-parallel activations between ranks of one group
KV_PORT: Final = 8083  # KV-transfer bootstrap (the data path may use other ports)
WORKER_PORTS: Final = {"http": HTTP_PORT, "status": STATUS_PORT, "pp": PP_PORT, "kv": KV_PORT}


def rank_config_key(role: WorkerRole, pp_rank: int) -> str:
    return f"{role}-rank-{pp_rank}.json"


def _service_host(meta: DeploymentMeta, service: str) -> str:
    return f"{service}.{meta.namespace}.svc"


def rank_config(
    spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan, role: WorkerRole, pp_rank: int
) -> dict[str, Any]:
    plan = memory.role(role)
    inputs = plan.inputs
    rank = plan.ranks[pp_rank]
    return {
        "version": CONFIG_VERSION,
        "deployment": meta.name,
        "namespace": meta.namespace,
        "role": role,
        "pp_rank": pp_rank,
        "pp_size": inputs.pp_size,
        "tp_size": inputs.tp_size,
        # Only the serving rank takes requests from the router; its /ready means "the whole
        # PP group is up", so routing is gated on the group.
        "serving_rank": pp_rank == SERVING_RANK,
        "model": {
            "preset": spec.model.preset,
            "config_path": spec.model.config_path,
            "weights_path": spec.model.weights.path if spec.model.weights else None,
        },
        "max_context_tokens": spec.max_context_tokens,
        "kv": {
            "page_size": inputs.resolved_page_size,
            "swa_ratio": inputs.swa_ratio,
            "transfer": spec.kv.transfer,
        },
        # The worker re-solves with the same planner from the memory it measures; these are
        # the inputs, and `planned` is what the operator expects (compared in status).
        "plan_inputs": {
            "device_memory_bytes": inputs.gpu_memory_bytes,
            "cpu_mode": spec.gpu.cpu_mode,
            "mem_fraction": inputs.mem_fraction,
            "chunked_prefill_tokens": inputs.resolved_chunk_tokens,
            "max_running_requests": plan.max_running_requests,
            "speculative_draft_tokens": inputs.speculative_draft_tokens,
            "context_len": inputs.resolved_context_len,
        },
        "planned": rank_to_dict(rank),
        "ports": dict(WORKER_PORTS),
        "peers": {
            # Fill {group} from DSV4_GROUP; ranks resolve through the group's headless Service.
            "host_template": "{group}-{rank}.{group}." + f"{meta.namespace}.svc",
            "pp_size": inputs.pp_size,
        },
        "role_services": {
            r: _service_host(meta, role_service_name(meta.name, r)) for r in WORKER_ROLES
        },
    }


def router_config(spec: DeploymentSpec, meta: DeploymentMeta) -> dict[str, Any]:
    return {
        "version": CONFIG_VERSION,
        "deployment": meta.name,
        "port": spec.router.port,
        "status_port": STATUS_PORT,
        "max_context_tokens": spec.max_context_tokens,
        "transfer": spec.kv.transfer,
        # Headless Services whose endpoints are the ready serving ranks (PP rank 0) only.
        "roles": {
            r: {
                "service": _service_host(meta, role_service_name(meta.name, r)),
                "port": HTTP_PORT,
                "bootstrap_port": KV_PORT,
            }
            for r in WORKER_ROLES
        },
    }


def _dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def config_data(spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan) -> dict[str, str]:
    """ConfigMap data: one document per (role, PP rank), the router's, and the whole plan."""
    data: dict[str, str] = {}
    for role in WORKER_ROLES:
        for rank in range(spec.role(role).pipeline_parallel):
            data[rank_config_key(role, rank)] = _dump(rank_config(spec, meta, memory, role, rank))
    data[ROUTER_CONFIG_KEY] = _dump(router_config(spec, meta))
    data[PLAN_KEY] = _dump({role: plan_to_dict(memory.role(role)) for role in WORKER_ROLES})
    return data


def role_config_data(data: dict[str, str], role: WorkerRole) -> dict[str, str]:
    """The part of the ConfigMap a role's pods read (its pod-template hash covers it)."""
    return {k: v for k, v in data.items() if k.startswith(f"{role}-rank-")}
