"""Label and annotation keys, child-object name templates and the CR name rule.

Owns every string the operator stamps on children, so builders, the pruner and the observer
agree on them. Pure: no Kubernetes client here.
"""

from __future__ import annotations

from typing import Final, Literal

from dsv4_common.api.names import (
    API_VERSION,
    GROUP,
    KIND,
    MAX_GROUP_INDEX,
    MAX_NAME_LENGTH,
    MAX_PIPELINE_PARALLEL,
    MAX_ROLE_REPLICAS,
    PLURAL,
    VERSION,
    WORKER_ROLES,
    WorkerRole,
    name_error,
)
from dsv4_common.api.rank_config import SERVING_RANK  # routing Services select it

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "MAX_NAME_LENGTH",
    "MAX_PIPELINE_PARALLEL",
    "MAX_ROLE_REPLICAS",
    "PLURAL",
    "SERVING_RANK",
    "VERSION",
    "WORKER_ROLES",
    "WorkerRole",
    "name_error",
]

FIELD_MANAGER: Final = "dsv4-operator"
Component = Literal["worker", "router"]

# Labels (selectors use these; never change a key without a migration).
APP_NAME: Final = "app.kubernetes.io/name"
APP_INSTANCE: Final = "app.kubernetes.io/instance"
APP_COMPONENT: Final = "app.kubernetes.io/component"
APP_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
DEPLOYMENT_LABEL: Final = f"{GROUP}/deployment"
ROLE_LABEL: Final = f"{GROUP}/role"
GROUP_LABEL: Final = f"{GROUP}/group"
REPLICA_LABEL: Final = f"{GROUP}/replica"
# Set by the StatefulSet controller on every pod (Kubernetes >= 1.28): the PP rank.
POD_INDEX_LABEL: Final = "apps.kubernetes.io/pod-index"
# Value `sglang`, on engine sglang's worker pods only: the chart's PodMonitor scrapes those on
# `http`, not `status`. NOTE: never on engine dsv4's pods (a new label in their template would
# change its hash and roll every existing deployment on an operator upgrade) nor on routers, and
# never in a selector (selectors are immutable).
ENGINE_LABEL: Final = f"{GROUP}/engine"
# An hf:// source's shared download objects (Job, its pods, the operator's claim, their
# NetworkPolicy): the download's key (dsv4_operator.weights.weights_key). They carry no
# deployment label: every DSV4Deployment of that model and commit shares them.
WEIGHTS_KEY_LABEL: Final = f"{GROUP}/weights-key"

# A Secret's owner opts it in as an hf:// source's hub token with this label, value "true": the
# operator reads the key of a Secret a CR names in spec.model.hub.tokenSecretRef (and renders the
# download Job's secretKeyRef to it) only when the Secret carries it. The label is consent to send
# that key to whatever endpoint the CR names (spec.model.hub.endpoint).
HUB_TOKEN_LABEL: Final = f"{GROUP}/hub-token"
HUB_TOKEN_LABEL_VALUE: Final = "true"

APP_NAME_VALUE: Final = "dsv4-serve"
MANAGED_BY_VALUE: Final = "dsv4-operator"
# Labels the operator's own pods carry (the chart must set them): the NetworkPolicy lets only
# these pods (and the metrics scrapers' namespace, when configured) reach the workers' status port.
OPERATOR_POD_LABELS: Final = {APP_NAME: "dsv4-operator"}
# Set by the API server on every namespace (>= 1.22): selects the metrics scrapers' namespace.
NAMESPACE_NAME_LABEL: Final = "kubernetes.io/metadata.name"

# Kueue's labels of a workload (queue, priority), set through a role's podTemplate labels and
# copied onto its StatefulSets (the router's Deployment) where Kueue reads them.
KUEUE_WORKLOAD_LABELS: Final = ("kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class")

# Annotations.
TEMPLATE_HASH_ANNOTATION: Final = f"{GROUP}/template-hash"
APPLIED_HASH_ANNOTATION: Final = f"{GROUP}/applied-hash"
# Worker pods of a `spec.model.configMapRef` model: a hash of the config.json they mount.
MODEL_CONFIG_HASH_ANNOTATION: Final = f"{GROUP}/model-config-hash"

# Name templates. Bounds on the variable parts keep every derived name legal.
# StatefulSet + headless Service of a PP group; a rollout's surge groups take the indices after
# the role's replicas.
GROUP_TEMPLATE: Final = "{name}-{role}-{replica}"
ROLE_SERVICE_TEMPLATE: Final = "{name}-{role}"  # routing Service + PDB per role
ROUTER_TEMPLATE: Final = "{name}-router"
CONFIG_TEMPLATE: Final = "{name}-config"
PD_SECRET_TEMPLATE: Final = "{name}-pd-secret"  # the deployment's PD secret (`dsv4 serve`)
SERVICE_ACCOUNT_TEMPLATE: Final = "{name}-workload"
NETWORK_POLICY_TEMPLATE: Final = "{name}-workers"
ROUTER_NETWORK_POLICY_TEMPLATE: Final = "{name}-router"

# NOTE: the StatefulSet controller labels pods with `controller-revision-hash: <sts>-<hash>`
# (label values <= 63, hash <= 10 chars), so a StatefulSet name may use at most 52 characters.
_MAX_STATEFULSET_NAME: Final = 63 - 11
_LONGEST_GROUP_SUFFIX: Final = len(
    GROUP_TEMPLATE.format(name="", role=max(WORKER_ROLES, key=len), replica=MAX_GROUP_INDEX)
)
_DERIVED_MAX_NAME_LENGTH: Final = _MAX_STATEFULSET_NAME - _LONGEST_GROUP_SUFFIX  # 41
# The CR name rule (names.MAX_NAME_LENGTH, 40) keeps one character of headroom below this.
assert MAX_NAME_LENGTH <= _DERIVED_MAX_NAME_LENGTH, "a legal CR name could give an illegal child"


def group_name(name: str, role: WorkerRole, replica: int) -> str:
    return GROUP_TEMPLATE.format(name=name, role=role, replica=replica)


def role_service_name(name: str, role: WorkerRole) -> str:
    return ROLE_SERVICE_TEMPLATE.format(name=name, role=role)


def router_name(name: str) -> str:
    return ROUTER_TEMPLATE.format(name=name)


def config_name(name: str) -> str:
    return CONFIG_TEMPLATE.format(name=name)


def pd_secret_name(name: str) -> str:
    return PD_SECRET_TEMPLATE.format(name=name)


def service_account_name(name: str) -> str:
    return SERVICE_ACCOUNT_TEMPLATE.format(name=name)


def network_policy_name(name: str) -> str:
    return NETWORK_POLICY_TEMPLATE.format(name=name)


def router_network_policy_name(name: str) -> str:
    return ROUTER_NETWORK_POLICY_TEMPLATE.format(name=name)


def owned_labels(name: str) -> dict[str, str]:
    """Labels on every child; the prune selector matches exactly these."""
    return {
        APP_NAME: APP_NAME_VALUE,
        APP_INSTANCE: name,
        APP_MANAGED_BY: MANAGED_BY_VALUE,
        DEPLOYMENT_LABEL: name,
    }


def component_labels(name: str, component: Component) -> dict[str, str]:
    return {**owned_labels(name), APP_COMPONENT: component}


def role_labels(name: str, role: WorkerRole) -> dict[str, str]:
    return {**component_labels(name, "worker"), ROLE_LABEL: role}


def group_labels(name: str, role: WorkerRole, replica: int) -> dict[str, str]:
    return {
        **role_labels(name, role),
        GROUP_LABEL: group_name(name, role, replica),
        REPLICA_LABEL: str(replica),
    }


# Pod selectors. NOTE: a workload's selector is immutable: each keeps to labels that never change.
def component_selector(name: str, component: Component) -> dict[str, str]:
    """The pods of one component (the workers, the router) of a deployment."""
    return {DEPLOYMENT_LABEL: name, APP_COMPONENT: component}


def role_selector(name: str, role: WorkerRole) -> dict[str, str]:
    return {**component_selector(name, "worker"), ROLE_LABEL: role}


def serving_selector(name: str, role: WorkerRole) -> dict[str, str]:
    """The serving rank (PP rank 0) of each of a role's groups: what routing selects."""
    return {**role_selector(name, role), POD_INDEX_LABEL: str(SERVING_RANK)}


def group_selector(name: str, group: str) -> dict[str, str]:
    """The pods of one PP group (`group_name`)."""
    return {DEPLOYMENT_LABEL: name, GROUP_LABEL: group}


def selector_string(labels: dict[str, str]) -> str:
    """`k=v,k=v` in key order (the form list calls take)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def prune_selector(name: str) -> str:
    return selector_string(
        {APP_MANAGED_BY: MANAGED_BY_VALUE, DEPLOYMENT_LABEL: name},
    )


def worker_selector(name: str) -> str:
    """The worker pods the operator observes (only pods of its own StatefulSets)."""
    return selector_string({APP_MANAGED_BY: MANAGED_BY_VALUE, **component_selector(name, "worker")})
