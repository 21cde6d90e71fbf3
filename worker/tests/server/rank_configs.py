"""A real rank config for tests: the tiny model's DSV4Deployment planned and rendered by the
shared builders, as the operator and `dsv4 up` render it."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.names import API_VERSION, KIND, WorkerRole
from dsv4_common.api.rank_config import RankConfig, WorkerPorts, build_rank_config
from dsv4_common.api.spec import parse_meta, parse_spec

PORTS = WorkerPorts(http=9001, status=9002, pp=9003, kv=9004)
SERVICES: dict[WorkerRole, str] = {"prefill": "prefill.svc", "decode": "decode.svc"}
HOST_TEMPLATE = "{group}-{rank}.peers"


def rank_config(
    role: WorkerRole = "decode", pp_rank: int = 0, *, pp_size: int = 1, **fields: Any
) -> RankConfig:
    """Rank `pp_rank` of a `role` group of `pp_size` stages; `fields` replace the result's."""
    body = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "opts", "namespace": "ns"},
        "spec": {
            "model": {
                "preset": "tiny",
                "weights": {"persistentVolumeClaim": "w", "path": "/models/tiny"},
            },
            "maxContextTokens": 1024,
            "gpu": {"memoryGiB": 0, "perPod": 0},
            "kv": {"pageSize": 16, "transfer": "zmq"},
            "prefill": {"replicas": 1, "pipelineParallel": pp_size},
            "decode": {"replicas": 1, "pipelineParallel": pp_size},
        },
    }
    spec = parse_spec(body)
    config = build_rank_config(
        spec,
        parse_meta(body),
        plan_memory(spec),
        role,
        pp_rank,
        peers_host_template=HOST_TEMPLATE,
        role_services=SERVICES,
        ports=PORTS,
    )
    return dataclasses.replace(config, **fields)
