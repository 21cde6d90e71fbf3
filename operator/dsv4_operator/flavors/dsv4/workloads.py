"""The containers of engine `dsv4`, built purely: the `worker` container (`dsv4 serve` reading
its rank config) and the `router` container (`dsv4 serve --role router`). Both probe our own
`/live` and `/ready` on the `status` port, which every rank serves.
"""

from __future__ import annotations

from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj
from dsv4_operator.workerconfig import CONFIG_DIR, STATUS_PORT
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


def _probe(path: str, period_s: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": "status"},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def worker_container(
    meta: DeploymentMeta, spec: DeploymentSpec, role: L.WorkerRole, image: str
) -> Obj:
    """The `worker` container of engine dsv4: `dsv4 serve` reading its rank config."""
    return {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["dsv4", "serve"],
        "args": ["--role", role, "--config-dir", CONFIG_DIR],
        "env": worker_env(meta, role),
        "ports": worker_ports(),
        "resources": worker_resources(spec),
        "startupProbe": _probe("/live", STARTUP_PERIOD_S, STARTUP_FAILURES),
        "livenessProbe": _probe("/live", 10, 3),
        # Every rank has it; on the serving rank /ready means "the whole PP group is up", and
        # only serving ranks are endpoints of the routing Service.
        "readinessProbe": _probe("/ready", 5, 2),
        "securityContext": container_security(),
    }


def router_container(meta: DeploymentMeta, spec: DeploymentSpec, image: str) -> Obj:
    """The `router` container of engine dsv4: `dsv4 serve --role router`."""
    return {
        "name": "router",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["dsv4", "serve"],
        "args": ["--role", "router", "--config-dir", CONFIG_DIR],
        "env": [
            {"name": "DSV4_DEPLOYMENT", "value": meta.name},
            {"name": "DSV4_ROLE", "value": "router"},
            {"name": "DSV4_CONFIG_DIR", "value": CONFIG_DIR},
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [
            {"name": "http", "containerPort": spec.router.port, "protocol": "TCP"},
            {"name": "status", "containerPort": STATUS_PORT, "protocol": "TCP"},
        ],
        "resources": {"requests": dict(ROUTER_REQUESTS), "limits": dict(ROUTER_LIMITS)},
        "livenessProbe": _probe("/live", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "securityContext": container_security(),
    }
