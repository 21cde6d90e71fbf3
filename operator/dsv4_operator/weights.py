"""An hf:// source's weights in a cluster, decided purely: the download shared by every
DSV4Deployment of one model, commit and cache claim in a namespace, the `WeightsReady`
condition, `status.weights` (progress, rate, ETA), the Events and the objects to apply.

The shared objects (one set per key = hash of repo, commit and claim):
- the cache claim: the user's (`spec.model.cache.persistentVolumeClaim`, never written), else an
  RWX claim `dsv4-hf-<key>` sized from the hub's file list;
- the Job `dsv4-fetch-<key>`: `dsv4 fetch hf://ORG/NAME@COMMIT` into the claim, resumable (a
  restarted pod goes on from the partial files), each file checked against the hub's hash, the
  tensors against the plan; exit 3 fails the Job at once (podFailurePolicy), other failures
  retry with backoff; its pod serves `GET :8081/progress` (the operator polls it) and writes
  its final document as the termination message;
- a NetworkPolicy admitting only the operator's pods to that port.
They carry a non-controller ownerReference per DSV4Deployment that uses them, so the garbage
collector deletes them with the last one (a claim you name is never touched).

Progress in status is written at most once per STATUS_MIN_INTERVAL_S per CR (a reconcile in
between keeps the previous figures); Events mark the start, each 10%, completion and failure.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Final, Literal, Protocol

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.fetch_status import (
    EXIT_PERMANENT,
    PROGRESS_PATH,
    FetchStatus,
    parse_fetch_status,
)
from dsv4_common.api.model_source import HF_CACHE_MOUNT_PATH, HfSource
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_common.core.units import GIB
from dsv4_common.plan.checkpoint_match import first_mismatch, planned_tensors
from dsv4_operator import labels as L
from dsv4_operator.manifests import Obj
from dsv4_operator.quantities import quantity
from dsv4_operator.status import Cond
from dsv4_operator.workloads import RUN_AS_USER, container_security

PROGRESS_PORT: Final = 8081
STATUS_MIN_INTERVAL_S: Final = 2.0
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

Phase = Literal["Resolving", "Pending", "Downloading", "Checking", "Ready", "Failed"]
EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Resolved:
    """What the hub said of the source at one commit."""

    source: HfSource  # as the spec names it (a branch, tag or commit)
    commit: str
    total_bytes: int
    files: int
    config_text: str | None  # None: the repo has no config.json


class HubError(Exception):
    """The hub refused or could not be asked; `reason` is CamelCase (Unauthorized, NotFound,
    HubUnavailable, SecretNotFound...), the message names the source."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Hub(Protocol):
    def resolve(self, source: HfSource, *, endpoint: str | None, token: str | None) -> Resolved:
        """`source` at the commit its revision names (raises HubError)."""
        ...


@dataclass(frozen=True, slots=True)
class Target:
    """The shared objects' names."""

    key: str
    claim: str
    owned_claim: bool  # the operator creates (and sizes) the claim
    job: str
    policy: str


@dataclass(frozen=True, slots=True)
class Seen:
    """The shared objects as the API holds them, and the running pod's progress document."""

    job: Mapping[str, Any] | None = None
    pods: tuple[Mapping[str, Any], ...] = ()
    claim: Mapping[str, Any] | None = None
    progress: FetchStatus | None = None


@dataclass(frozen=True, slots=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Owner:
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class WeightsDecision:
    ready: bool  # the workers may be built (an hf:// source is complete and matches the plan)
    condition: Cond
    status: dict[str, Any] | None = None  # status.weights (hf:// only)
    objects: tuple[Obj, ...] = ()  # to apply, in order
    recreate_job: bool = False  # the Job's template changed: delete it (the next one resumes)
    events: tuple[Event, ...] = ()
    target: Target | None = None


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


# --- decisions -------------------------------------------------------------------------------


def not_hf(spec: DeploymentSpec) -> WeightsDecision:
    """Sources the operator does not download: a claim, or random weights."""
    weights = spec.model.weights
    if weights is not None:
        where = f"claim {weights.persistent_volume_claim}"
        if weights.sub_path:
            where += f" at {weights.sub_path}"
        return WeightsDecision(True, Cond("WeightsReady", "True", "OnVolume", f"read from {where}"))
    return WeightsDecision(
        True, Cond("WeightsReady", "True", "NoWeights", "no weights source: random weights")
    )


def unresolved(
    spec: DeploymentSpec, reason: str, message: str, previous: Mapping[str, Any], now: datetime
) -> WeightsDecision:
    """The hub could not be asked, or refused (a Secret missing, 401, 404, unreachable)."""
    hf = spec.model.hf
    assert hf is not None
    phase: Phase = "Resolving" if reason == "HubUnavailable" else "Failed"
    status = {"source": hf.uri, "phase": phase, "progress": phase, "reason": reason}
    events = _events(previous.get("weights") or {}, status, message)
    return WeightsDecision(
        False,
        Cond("WeightsReady", "False", reason, f"spec.model.source: {message}"),
        _stamped(status, now),
        events=events,
    )


def config_mismatch(
    spec: DeploymentSpec, planned: ModelConfig, repo: ModelConfig | None
) -> str | None:
    """When the plan's model (a preset or config the CR names) is not the repo's config.json's:
    the first tensor they differ on; None when they agree (or the repo has no config.json)."""
    if repo is None or spec.model.config_from_origin:
        return None
    draft = spec.speculative_draft_tokens > 0
    index = dict(planned_tensors(repo, with_draft=draft)) if isinstance(repo, DSV4Config) else {}
    if not index:
        return None
    mismatch = first_mismatch(planned, index, with_draft=draft)
    return None if mismatch is None else mismatch.message


def decide(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    resolved: Resolved,
    seen: Seen,
    *,
    owners: Sequence[Owner],
    previous: Mapping[str, Any],
    now: datetime,
    image: str,
    endpoint: str | None,
    tensor_mismatch: str | None = None,
) -> WeightsDecision:
    """The decision for a resolved hf:// source (`previous`: the CR's status as it was)."""
    target = target_of(spec, resolved)
    before = previous.get("weights") or {}
    base: dict[str, Any] = {
        "source": resolved.source.uri,
        "revision": resolved.commit,
        "key": target.key,
        "claim": target.claim,
        "job": target.job,
        "bytesTotal": resolved.total_bytes,
        "filesTotal": resolved.files,
    }

    def finish(
        phase: Phase,
        cond: Cond,
        objects: tuple[Obj, ...] = (),
        progress: FetchStatus | None = None,
        recreate: bool = False,
    ) -> WeightsDecision:
        status = {**base, "phase": phase, **_figures(phase, resolved, progress)}
        if cond.status == "False" and phase == "Failed":
            status["reason"] = cond.reason
        status = _throttled(status, before, now)
        if progress is not None:  # the message says what status says (throttled alike)
            cond = replace(cond, message=f"Job {target.job}: {_described(status)}")
        events = _events(before, status, cond.message)
        return WeightsDecision(phase == "Ready", cond, status, objects, recreate, events, target)

    if tensor_mismatch is not None:
        return finish(
            "Failed",
            Cond(
                "WeightsReady",
                "False",
                "TensorMismatch",
                f"spec.model: the model the plan counts is not {resolved.source.repo_id}'s "
                f"config.json: {tensor_mismatch}",
            ),
        )
    size = claim_bytes(spec, resolved)
    if target.owned_claim and spec.model.cache.size is not None:
        asked = quantity(spec.model.cache.size)
        if asked is None or asked < resolved.total_bytes:
            return finish(
                "Failed",
                Cond(
                    "WeightsReady",
                    "False",
                    "VolumeTooSmall",
                    f"spec.model.cache.size {spec.model.cache.size} cannot hold "
                    f"{resolved.source.uri} ({_gib(resolved.total_bytes)} in {resolved.files} "
                    "files)",
                ),
            )
        size = max(size, math.ceil(float(asked) / GIB) * GIB)
    if not target.owned_claim:
        why = _claim_problem(target, seen.claim, resolved)
        if why is not None:
            return finish("Failed", Cond("WeightsReady", "False", why[0], why[1]))
    objects: list[Obj] = []
    if target.owned_claim:
        objects.append(build_claim(target, meta.namespace, spec, size, owners))
    objects.append(build_fetch_policy(target, meta.namespace, owners))
    job = build_job(
        target, meta.namespace, spec, resolved, image=image, endpoint=endpoint, owners=owners
    )
    live = seen.job
    state = _job_state(live)
    if state == "complete":
        objects.append(job if live is None else _keep_template(job, live))
        final = _final_document(seen.pods, succeeded=True)
        if spec.speculative_draft_tokens > 0 and final is not None and not final.draft_layers:
            return finish(
                "Failed",
                Cond(
                    "WeightsReady",
                    "False",
                    "TensorMismatch",
                    f"{resolved.source.uri}@{resolved.commit[:12]} holds no MTP layers as the "
                    "plan counts them; spec.speculativeDraftTokens needs them",
                ),
                tuple(objects),
            )
        checked = final.message if final is not None and final.message else "verified"
        return finish(
            "Ready",
            Cond(
                "WeightsReady",
                "True",
                "Downloaded",
                f"{resolved.source.uri} is {resolved.commit} in claim {target.claim} ({checked})",
            ),
            tuple(objects),
        )
    if state == "failed":
        objects.append(_keep_template(job, live) if live is not None else job)
        final = _final_document(seen.pods, succeeded=False)
        reason = final.reason if final is not None and final.reason else "DownloadFailed"
        message = final.message if final is not None and final.message else _job_failure(live)
        return finish(
            "Failed",
            Cond(
                "WeightsReady",
                "False",
                reason,
                f"Job {target.job}: {message} (delete the Job to try again)",
            ),
            tuple(objects),
        )
    recreate = live is not None and _template_hash(live) != _template_hash(job)
    if not recreate:
        objects.append(job)
    progress = seen.progress
    if progress is not None and progress.commit not in (None, resolved.commit):
        progress = None
    if progress is None or progress.phase in ("resolving",):
        waiting = _pod_waiting(seen.pods)
        return finish(
            "Pending",
            Cond(
                "WeightsReady",
                "False",
                "Downloading",
                f"Job {target.job} is starting: {waiting}"
                if live is not None
                else f"creating Job {target.job} for {resolved.source.uri} "
                f"({_gib(resolved.total_bytes)}, {resolved.files} files) into claim "
                f"{target.claim}",
            ),
            tuple(objects),
            recreate=recreate,
        )
    phase: Phase = "Checking" if progress.phase in ("checking", "complete") else "Downloading"
    return finish(
        phase,
        Cond("WeightsReady", "False", "Downloading", ""),  # the message: from status
        tuple(objects),
        progress,
        recreate,
    )


def _described(status: Mapping[str, Any]) -> str:
    """`42% (67.0 GiB of 160.0 GiB, 3/12 files), 210.0 MB/s, ETA 11 min`, from status.weights."""
    eta = status.get("etaSeconds")
    when = "" if eta is None else f", ETA {_duration(float(eta))}"
    return (
        f"{status['progress']} ({_gib(status['bytesDone'])} of {_gib(status['bytesTotal'])}, "
        f"{status['filesDone']}/{status['filesTotal']} files), "
        f"{status['bytesPerSecond'] / 1e6:.1f} MB/s{when}"
    )


# --- helpers ---------------------------------------------------------------------------------


def _hash(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _template_hash(job: Mapping[str, Any]) -> str | None:
    template = (job.get("spec") or {}).get("template") or {}
    value = ((template.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH)
    return value if isinstance(value, str) else None


def _keep_template(job: Obj, live: Mapping[str, Any]) -> Obj:
    """A finished Job keeps the template it ran with (immutable): only its metadata is
    applied (owners)."""
    kept = dict(job)
    kept["spec"] = dict(job["spec"])
    kept["spec"]["template"] = (live.get("spec") or {}).get("template") or job["spec"]["template"]
    return kept


def _job_state(job: Mapping[str, Any] | None) -> Literal["none", "running", "complete", "failed"]:
    if job is None:
        return "none"
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") == "Complete":
            return "complete"
        if c.get("status") == "True" and c.get("type") == "Failed":
            return "failed"
    return "running"


def _job_failure(job: Mapping[str, Any] | None) -> str:
    for c in ((job or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return f"{c.get('reason', 'Failed')}: {c.get('message', '')}".strip(": ")
    return "failed"


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == "fetch":
            terminated = (status.get("state") or {}).get("terminated")
            if isinstance(terminated, Mapping):
                return terminated
    return None


def _final_document(pods: Sequence[Mapping[str, Any]], *, succeeded: bool) -> FetchStatus | None:
    """The termination message of the newest pod that ended (as wanted), parsed."""
    ended = [
        (t.get("finishedAt") or "", t)
        for pod in pods
        if (t := _terminated(pod)) is not None and (t.get("exitCode") == 0) == succeeded
    ]
    for _, terminated in sorted(ended, key=lambda e: str(e[0]), reverse=True):
        try:
            return parse_fetch_status(json.loads(terminated.get("message") or ""))
        except (ValueError, DocumentError):
            continue
    return None


def _pod_waiting(pods: Sequence[Mapping[str, Any]]) -> str:
    """Why the Job's pod is not running yet, in the kubelet's or the scheduler's words."""
    for pod in pods:
        status = pod.get("status") or {}
        for c in status.get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting")
            if waiting:
                return f"{waiting.get('reason', 'waiting')}: {waiting.get('message', '')}".strip(
                    ": "
                )
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return f"{c.get('reason', 'Unschedulable')}: {c.get('message', '')}".strip(": ")
        if status.get("phase"):
            return f"pod {status['phase']}"
    return "no pod yet"


def _claim_problem(
    target: Target, claim: Mapping[str, Any] | None, resolved: Resolved
) -> tuple[str, str] | None:
    """A claim the user names: it must exist and hold at least the files (the Job checks the
    space left on it)."""
    if claim is None:
        return (
            "ClaimNotFound",
            f"spec.model.cache.persistentVolumeClaim: claim {target.claim} not found in this "
            "namespace",
        )
    capacity = ((claim.get("status") or {}).get("capacity") or {}).get("storage")
    size = quantity(capacity) if capacity is not None else None
    if size is not None and size < resolved.total_bytes:
        return (
            "VolumeTooSmall",
            f"spec.model.cache.persistentVolumeClaim: claim {target.claim} holds {capacity}, "
            f"{resolved.source.uri} needs {_gib(resolved.total_bytes)} ({resolved.files} files)",
        )
    return None


def _figures(phase: Phase, resolved: Resolved, p: FetchStatus | None) -> dict[str, Any]:
    eta: int | None
    if phase == "Ready":
        done, files, rate, eta = resolved.total_bytes, resolved.files, 0.0, 0
    elif p is not None:
        done, files, rate = p.bytes_done, p.files_done, p.bytes_per_second
        eta = None if p.eta_seconds is None else round(p.eta_seconds)
    else:
        done, files, rate, eta = 0, 0, 0.0, None
    total = max(resolved.total_bytes, 1)
    percent = 100 if phase == "Ready" else min(99, done * 100 // total)
    out: dict[str, Any] = {
        "bytesDone": done,
        "filesDone": files,
        "bytesPerSecond": round(rate),
        "progress": f"{percent}%" if phase != "Failed" else "Failed",
    }
    if eta is not None:
        out["etaSeconds"] = eta
    return out


_PROGRESS_KEYS: Final = ("bytesDone", "filesDone", "bytesPerSecond", "etaSeconds", "progress")


def _throttled(status: dict[str, Any], before: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """At most one progress write per STATUS_MIN_INTERVAL_S: when only the figures moved since
    a write less than that ago, the previous figures (and their time) stay."""
    last = before.get("updateTime")
    same = {k: v for k, v in status.items() if k not in _PROGRESS_KEYS}
    same_before = {k: v for k, v in before.items() if k not in (*_PROGRESS_KEYS, "updateTime")}
    if isinstance(last, str) and same == same_before:
        if all(status.get(k) == before.get(k) for k in _PROGRESS_KEYS):
            return {**status, "updateTime": last}
        seconds = (now - _parse_time(last)).total_seconds()
        if 0 <= seconds < STATUS_MIN_INTERVAL_S:
            return {
                **same,
                **{k: before[k] for k in _PROGRESS_KEYS if k in before},
                "updateTime": last,
            }
    return _stamped(status, now)


def _stamped(status: dict[str, Any], now: datetime) -> dict[str, Any]:
    return {**status, "updateTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}


def _parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def _decile(status: Mapping[str, Any]) -> int:
    progress = str(status.get("progress") or "")
    return int(progress[:-1]) // 10 if progress.endswith("%") and progress[:-1].isdigit() else -1


def _events(before: Mapping[str, Any], after: Mapping[str, Any], message: str) -> tuple[Event, ...]:
    """Start, each 10%, completion and failure, from the change of status.weights."""
    was, now = before.get("phase"), after.get("phase")
    source = after.get("source", "")
    if now == was and now not in ("Downloading", "Checking"):
        return ()
    if now == "Ready":
        return (Event("Normal", "WeightsReady", message),)
    if now == "Failed":
        return (Event("Warning", "WeightsFailed", message),)
    out: list[Event] = []
    if now in ("Pending", "Downloading") and was not in ("Pending", "Downloading", "Checking"):
        total = after.get("bytesTotal")
        size = f" ({_gib(int(total))}, {after.get('filesTotal')} files)" if total else ""
        out.append(
            Event(
                "Normal",
                "WeightsDownloading",
                f"downloading {source}{size} with Job {after.get('job')} into claim "
                f"{after.get('claim')}",
            )
        )
    decile = _decile(after)
    if now == "Downloading" and decile >= 1 and decile > max(_decile(before), 0):
        out.append(Event("Normal", "WeightsProgress", message))
    return tuple(out)


def _gib(n: int) -> str:
    """A size in GiB, or MiB below one GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_url(ip: str) -> str:
    return f"http://{ip}:{PROGRESS_PORT}{PROGRESS_PATH}"
