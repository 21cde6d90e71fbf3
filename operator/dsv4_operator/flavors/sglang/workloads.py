"""The containers that differ for engine `sglang`, built purely: the `worker` container
(SGLang's server with the command line of `command.py`) and the `router` container
(sglang-router in PD mode over the groups that exist).

NOTE: only PP rank 0 of an SGLang PP group serves HTTP (ranks > 0 run schedulers only), yet
all ranks share one pod template. The probes are therefore exec probes that pass at once on a
rank > 0 (its process is alive while its container runs: SGLang exits when a rank fails) and
ask SGLang's own endpoints on rank 0, whose health needs the whole pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.flavors.sglang.command import (
    PP_RANK_ENV,
    ROUTER_COMMAND,
    SERVER_COMMAND,
    router_args,
    server_args,
    server_env,
)
from dsv4_operator.flavors.sglang.flags import SGLANG_VERSION
from dsv4_operator.manifests import Obj
from dsv4_operator.workerconfig import HTTP_PORT, STATUS_PORT
from dsv4_operator.workloads import (
    ROUTER_LIMITS,
    ROUTER_REQUESTS,
    STARTUP_FAILURES,
    STARTUP_PERIOD_S,
    container_security,
    worker_env,
    worker_ports,
    worker_resources,
)

# The image whose flags the operator checks engineArgs against (its snapshot's version).
DEFAULT_SGLANG_IMAGE: Final = f"lmsysorg/sglang:v{SGLANG_VERSION}"
# SGLang's /health runs a one-token generation and waits up to SGLANG_HEALTH_CHECK_TIMEOUT
# (20 s) for it; /ready answers from the server's state at once.
HEALTH_TIMEOUT_S: Final = 25
READY_TIMEOUT_S: Final = 2
# Exit 0 on a PP rank > 0; on rank 0, exit 0 iff GET http://127.0.0.1:<http><path> is 2xx.
_PROBE: Final = (
    "import os, sys, urllib.request\n"
    f"if os.environ.get('{PP_RANK_ENV}', '0') != '0':\n"
    "    sys.exit(0)\n"
    f"urllib.request.urlopen('http://127.0.0.1:{HTTP_PORT}' + sys.argv[1], "
    "timeout=float(sys.argv[2]))\n"
)


def rank0_probe(path: str, timeout_s: int, period_s: int, failures: int) -> Obj:
    return {
        "exec": {"command": ["python3", "-c", _PROBE, path, str(timeout_s)]},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": timeout_s + 5,  # the interpreter's start-up on top
    }


def sglang_worker_container(
    meta: DeploymentMeta,
    spec: DeploymentSpec,
    memory: MemoryPlan,
    role: L.WorkerRole,
    replica: int,
    image: str,
) -> Obj:
    own = worker_env(meta, role)
    names = {e["name"] for e in own}
    extra = [{"name": k, "value": v} for k, v in server_env(memory, role).items() if k not in names]
    # SGLang registers this address with the bootstrap server (else it guesses an interface).
    host_ip = {
        "name": "SGLANG_HOST_IP",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
    }
    return {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(SERVER_COMMAND),
        "args": list(server_args(spec, meta, memory, role, replica)),
        "env": [*own, *extra, host_ip],
        "ports": worker_ports(),
        "resources": worker_resources(spec),
        "startupProbe": rank0_probe(
            "/health", HEALTH_TIMEOUT_S, STARTUP_PERIOD_S, STARTUP_FAILURES
        ),
        "livenessProbe": rank0_probe("/health", HEALTH_TIMEOUT_S, 30, 3),
        "readinessProbe": rank0_probe("/ready", READY_TIMEOUT_S, 5, 2),
        "securityContext": container_security(),
    }


def sglang_router_container(
    meta: DeploymentMeta,
    spec: DeploymentSpec,
    image: str,
    surge: Mapping[L.WorkerRole, int] | None = None,
) -> Obj:
    """sglang-router over the groups that exist (`surge`: the surge groups in use)."""
    http = {"port": "http"}
    return {
        "name": "router",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(ROUTER_COMMAND),
        "args": list(router_args(spec, meta, surge)),
        "env": [
            {"name": "DSV4_DEPLOYMENT", "value": meta.name},
            {"name": "DSV4_ROLE", "value": "router"},
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [
            {"name": "http", "containerPort": spec.router.port, "protocol": "TCP"},
            # --prometheus-port: the router's metrics, where its PodMonitor scrapes
            {"name": "status", "containerPort": STATUS_PORT, "protocol": "TCP"},
        ],
        "resources": {"requests": dict(ROUTER_REQUESTS), "limits": dict(ROUTER_LIMITS)},
        "livenessProbe": {
            "httpGet": {"path": "/liveness", **http},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 2,
        },
        # sglang-router's own readiness (the health of the workers it routes to).
        "readinessProbe": {
            "httpGet": {"path": "/readiness", **http},
            "periodSeconds": 5,
            "failureThreshold": 2,
            "timeoutSeconds": 2,
        },
        "securityContext": container_security(),
    }
