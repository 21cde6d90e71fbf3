"""Names the whole project agrees on, defined once: the CRD's identity, worker roles, transfer
backends, the presets a DSV4Deployment may name, the CR name rule and the CRD's bounds.

The CRD's enums and bounds are tested against these. Pure.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from dsv4_common.core.presets import PRESETS

# The custom resource.
GROUP: Final = "serving.dsv4.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "DSV4Deployment"
PLURAL: Final = "dsv4deployments"

# Worker roles a DSV4Deployment deploys (the planner also knows "colocated").
WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: Final[tuple[WorkerRole, ...]] = ("prefill", "decode")

# KV transfer backends (`spec.kv.transfer`, `dsv4 serve --transfer`).
Transfer = Literal["nixl", "mooncake", "zmq"]
TRANSFERS: Final[tuple[Transfer, ...]] = ("nixl", "mooncake", "zmq")
DEFAULT_TRANSFER: Final[Transfer] = "nixl"

# The engine that serves a DSV4Deployment (`spec.engine.name`): our worker, or SGLang
# (`python3 -m sglang.launch_server`, fronted by sglang-router).
Engine = Literal["dsv4", "sglang"]
ENGINES: Final[tuple[Engine, ...]] = ("dsv4", "sglang")
DEFAULT_ENGINE: Final[Engine] = "dsv4"
# The transfer backends each engine has: our worker's (`dsv4 serve --transfer`; no Mooncake)
# and SGLang's (--disaggregation-transfer-backend; no zmq).
DSV4_TRANSFERS: Final[tuple[Transfer, ...]] = ("nixl", "zmq")
SGLANG_TRANSFERS: Final[tuple[Transfer, ...]] = ("nixl", "mooncake")
MAX_ENGINE_ARGS: Final = 64  # entries of spec.<role>.engineArgs
MAX_ENGINE_ARG_LENGTH: Final = 1024
# `spec.model.servedModelNames`: the names the API answers to (`model`, /v1/models).
MAX_SERVED_MODEL_NAMES: Final = 16
MAX_SERVED_MODEL_NAME_LENGTH: Final = 256

# The compute dtype of a worker's arithmetic (`spec.model.dtype`, `dsv4 serve --dtype`): auto is
# bfloat16 on a GPU and float32 on CPU; float64 only when asked (oracle tests). It never decides
# how weights or KV rows are stored (they follow the checkpoint and the plan).
ComputeDtype = Literal["auto", "bfloat16", "float32", "float64"]
COMPUTE_DTYPES: Final[tuple[ComputeDtype, ...]] = ("auto", "bfloat16", "float32", "float64")
DEFAULT_COMPUTE_DTYPE: Final[ComputeDtype] = "auto"

# Presets `spec.model.preset` may name: every built-in preset. CPU mode (no GPU) runs only
# the CPU-sized ones.
MODEL_PRESETS: Final[tuple[str, ...]] = tuple(PRESETS)
CPU_PRESETS: Final = frozenset({"tiny", "hybrid-tiny"})

# The extended resource that counts GPUs (set by gpu.perPod, never by resources).
GPU_RESOURCE: Final = "nvidia.com/gpu"

# Gang scheduling of a PP group (`spec.scheduling.gang`) and how its pods are placed in the
# topology domain of `spec.scheduling.topologyKey` (`spec.scheduling.topologyPolicy`).
GangScheduler = Literal["none", "volcano", "coscheduling"]
GANG_SCHEDULERS: Final[tuple[GangScheduler, ...]] = ("none", "volcano", "coscheduling")
TopologyPolicy = Literal["preferred", "required"]
TOPOLOGY_POLICIES: Final[tuple[TopologyPolicy, ...]] = ("preferred", "required")

# Bounds the CRD enforces (child names are derived from them; see the operator's labels).
MAX_ROLE_REPLICAS: Final = 64
# Surge groups of a rollout take the indices after the role's replicas (spec.<role>.rollout).
MAX_SURGE: Final = 16
MAX_GROUP_INDEX: Final = MAX_ROLE_REPLICAS + MAX_SURGE - 1  # 79: at most 2 digits
MAX_PIPELINE_PARALLEL: Final = 16  # PP rank <= 15
MAX_LAYERS_PER_RANK: Final = 1024  # an entry of spec.<role>.layerSplit
MAX_TENSOR_PARALLEL: Final = 16
# The CRD's CEL rule allows names of at most 40 characters, so every child name stays legal.
MAX_NAME_LENGTH: Final = 40
# DNS-1035 label: Services need a leading letter.
NAME_PATTERN: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


# A Kubernetes namespace is a DNS-1123 label.
NAMESPACE_PATTERN: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAMESPACE_LENGTH: Final = 63


def namespace_error(namespace: str) -> str | None:
    """Why `namespace` cannot be a Kubernetes namespace, or None when it can."""
    if len(namespace) > MAX_NAMESPACE_LENGTH or not NAMESPACE_PATTERN.match(namespace):
        return (
            f"{namespace!r} must be a DNS-1123 label: at most {MAX_NAMESPACE_LENGTH} lower-case "
            "letters, digits and '-', starting and ending with a letter or digit"
        )
    return None


def name_error(name: str) -> str | None:
    """Why `name` cannot be a DSV4Deployment name, or None when it can."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_NAME_LENGTH:
        return (
            f"{name!r} has {len(name)} characters; at most {MAX_NAME_LENGTH} so that every "
            "child name (e.g. the StatefulSet of a PP group) stays legal"
        )
    if not NAME_PATTERN.match(name):
        return (
            f"{name!r} must be a DNS-1035 label: lower-case letters, digits and '-', "
            "starting with a letter and ending with a letter or digit"
        )
    return None
