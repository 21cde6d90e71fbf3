"""The shared objects of an hf:// source's download in a namespace, built purely (`weights.py`
decides when): the cache claim the operator creates, the download Job and its NetworkPolicy,
named and labelled by the download's key (a hash of the repo, the commit and a user's claim).

- the claim: `dsv4-hf-<key>`, ReadWriteMany, sized from the hub's file list (a claim the user
  names is never built);
- the Job `dsv4-fetch-<key>`: `dsv4 fetch hf://ORG/NAME@COMMIT` into the claim, resumable (a
  restarted pod goes on from the partial files), each file checked against the hub's hash, the
  tensors against the plan; exit 3 fails the Job at once (podFailurePolicy), other failures
  retry with backoff; its pod serves `GET :8081/progress` and writes its final document as the
  termination message; its template's hash is an annotation (the template is immutable);
- a NetworkPolicy admitting only the operator's pods to that port.
Each carries a non-controller ownerReference per DSV4Deployment that uses it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dsv4_common.api.fetch_status import EXIT_PERMANENT
from dsv4_common.api.model_source import HF_CACHE_MOUNT_PATH, HfSource
from dsv4_common.api.spec import DeploymentSpec
from dsv4_common.core.units import GIB
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj
from dsv4_operator.workloads import RUN_AS_USER, container_security

PROGRESS_PORT: Final = 8081
JOB_BACKOFF_LIMIT: Final = 6
CLAIM_MARGIN: Final = 0.05  # the operator's claim: the files plus 5% and 1 GiB
CLAIM_SLACK_BYTES: Final = GIB
FETCH_REQUESTS: Final = {"cpu": "1", "memory": "1Gi"}
FETCH_LIMITS: Final = {"memory": "2Gi"}
JOB_PREFIX: Final = "dsv4-fetch-"
CLAIM_PREFIX: Final = "dsv4-hf-"
COMPONENT: Final = "weights"
TEMPLATE_HASH: Final = L.TEMPLATE_HASH_ANNOTATION
SOURCE_ANNOTATION: Final = f"{L.GROUP}/source"


@dataclass(frozen=True, slots=True)
class Resolved:
    """What the hub said of the source at one commit."""

    source: HfSource  # as the spec names it (a branch, tag or commit)
    commit: str
    total_bytes: int
    files: int
    config_text: str | None  # None: the repo has no config.json


@dataclass(frozen=True, slots=True)
class Target:
    """The shared objects' names."""

    key: str
    claim: str
    owned_claim: bool  # the operator creates (and sizes) the claim
    job: str
    policy: str


@dataclass(frozen=True, slots=True)
class Owner:
    name: str
    uid: str


def weights_key(repo_id: str, commit: str, claim: str | None) -> str:
    """12 hex digits naming one download: the model, its commit and the user's claim (if any)."""
    text = f"{repo_id}@{commit}|{claim or ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def target_of(spec: DeploymentSpec, resolved: Resolved) -> Target:
    user_claim = spec.model.cache.persistent_volume_claim
    key = weights_key(resolved.source.repo_id, resolved.commit, user_claim)
    return Target(
        key=key,
        claim=user_claim or f"{CLAIM_PREFIX}{key}",
        owned_claim=user_claim is None,
        job=f"{JOB_PREFIX}{key}",
        policy=f"{JOB_PREFIX}{key}",
    )


def claim_bytes(spec: DeploymentSpec, resolved: Resolved) -> int:
    """The operator's claim: `cache.size`, else the files plus the margin, whole GiB."""
    need = resolved.total_bytes * (1 + CLAIM_MARGIN) + CLAIM_SLACK_BYTES
    return math.ceil(need / GIB) * GIB


def labels_of(key: str) -> dict[str, str]:
    return {
        L.APP_NAME: L.APP_NAME_VALUE,
        L.APP_MANAGED_BY: L.MANAGED_BY_VALUE,
        L.APP_COMPONENT: COMPONENT,
        L.WEIGHTS_KEY_LABEL: key,
    }


def _meta(name: str, namespace: str, key: str, owners: Sequence[Owner]) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "labels": labels_of(key)}
    if owners:
        meta["ownerReferences"] = [
            {
                "apiVersion": L.API_VERSION,
                "kind": L.KIND,
                "name": o.name,
                "uid": o.uid,
                "controller": False,
                "blockOwnerDeletion": False,
            }
            for o in sorted(owners, key=lambda o: o.uid)
        ]
    return meta


def build_claim(
    target: Target, namespace: str, spec: DeploymentSpec, size_bytes: int, owners: Sequence[Owner]
) -> Obj:
    pvc_spec: Obj = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": f"{size_bytes // GIB}Gi"}},
    }
    if spec.model.cache.storage_class_name is not None:
        pvc_spec["storageClassName"] = spec.model.cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(target.claim, namespace, target.key, owners),
        "spec": pvc_spec,
    }


def fetch_pod_selector(key: str) -> dict[str, str]:
    return {L.APP_COMPONENT: COMPONENT, L.WEIGHTS_KEY_LABEL: key}


def build_job(
    target: Target,
    namespace: str,
    spec: DeploymentSpec,
    resolved: Resolved,
    *,
    image: str,
    endpoint: str | None,
    owners: Sequence[Owner],
) -> Obj:
    """The download Job. Its template is immutable once created: its hash is an annotation, and
    a Job whose template changed is recreated (`WeightsDecision.recreate_job`)."""
    env: list[Obj] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if endpoint is not None:
        env.append({"name": "HF_ENDPOINT", "value": endpoint})
    # `resolved` exists only when weights_step.read_token found this Secret opted in (labelled
    # labels.HUB_TOKEN_LABEL): no Job ever refers to a Secret its owner did not offer.
    if (secret := spec.model.hub.token_secret) is not None:
        ref = {"name": secret.name, "key": secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    source = resolved.source.at(resolved.commit)
    container: Obj = {
        "name": "fetch",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["dsv4", "fetch"],
        "args": [
            source.uri,
            "--cache-dir",
            HF_CACHE_MOUNT_PATH,
            "--progress-port",
            str(PROGRESS_PORT),
            "--progress",
            "log",
            "--termination-log",
            "/dev/termination-log",
        ],
        "env": env,
        "ports": [{"name": "progress", "containerPort": PROGRESS_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(FETCH_REQUESTS), "limits": dict(FETCH_LIMITS)},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "cache", "mountPath": HF_CACHE_MOUNT_PATH},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod: Obj = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "cache", "persistentVolumeClaim": {"claimName": target.claim}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    template: Obj = {"metadata": {"labels": labels_of(target.key)}, "spec": pod}
    template["metadata"]["annotations"] = {TEMPLATE_HASH: _hash(template)}
    meta = _meta(target.job, namespace, target.key, owners)
    meta["annotations"] = {SOURCE_ANNOTATION: source.uri}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": JOB_BACKOFF_LIMIT,
            # Exit 3: a retry cannot help (a hash mismatch twice, 401, 404, a full volume, the
            # tensors): fail now. A pod disrupted (evicted, its node drained) does not count.
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": "fetch",
                            "operator": "In",
                            "values": [EXIT_PERMANENT],
                        },
                    },
                    {
                        "action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                ]
            },
            "template": template,
        },
    }


def build_fetch_policy(target: Target, namespace: str, owners: Sequence[Owner]) -> Obj:
    """Only the operator's pods reach the progress port; the pod may reach anything (the hub,
    its CDN, a mirror)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(target.policy, namespace, target.key, owners),
        "spec": {
            "podSelector": {"matchLabels": fetch_pod_selector(target.key)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": dict(L.OPERATOR_POD_LABELS)},
                        }
                    ],
                    "ports": [{"port": "progress", "protocol": "TCP"}],
                }
            ],
        },
    }


def _hash(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def template_hash(job: Mapping[str, Any]) -> str | None:
    template = (job.get("spec") or {}).get("template") or {}
    value = ((template.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH)
    return value if isinstance(value, str) else None
