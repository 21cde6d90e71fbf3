"""An hf:// source's weights in a cluster, decided purely: the download shared by every
DSV4Deployment of one model, commit and cache claim in a namespace (its objects:
`weights_objects.py`), the `WeightsReady` condition, `status.weights` and the Events
(`weights_progress.py`), and which objects to apply.

    1. the CR's model is not the repo's config.json's (a preset or config besides an hf://
       source): TensorMismatch, nothing applied
    2. the claim: `cache.size` below the files, or a user's claim missing or smaller than the
       files: VolumeTooSmall / ClaimNotFound, nothing applied
    3. apply the operator's claim, the NetworkPolicy and the Job (a running Job whose template
       changed is recreated; a finished one keeps its template)
    4. the Job complete: Ready (unless speculation needs MTP layers the checkpoint lacks);
       failed: the reason and message its pod's termination message names; running: the
       progress its pod serves
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal, Protocol

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.fetch_status import FetchStatus, parse_fetch_status
from dsv4_common.api.model_source import HfSource
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_common.core.units import GIB
from dsv4_common.plan.checkpoint_match import first_mismatch, planned_tensors
from dsv4_operator.manifests import Obj
from dsv4_operator.quantities import quantity
from dsv4_operator.status import Cond
from dsv4_operator.weights_objects import (
    PROGRESS_PORT,
    Owner,
    Resolved,
    Target,
    build_claim,
    build_fetch_policy,
    build_job,
    claim_bytes,
    fetch_pod_selector,
    target_of,
    template_hash,
    weights_key,
)
from dsv4_operator.weights_progress import (
    Event,
    Phase,
    described,
    events,
    figures,
    gib_text,
    stamped,
    throttled,
)

__all__ = [
    "PROGRESS_PORT",
    "Event",
    "Hub",
    "HubError",
    "Owner",
    "Resolved",
    "Seen",
    "Target",
    "WeightsDecision",
    "config_mismatch",
    "decide",
    "fetch_pod_selector",
    "not_hf",
    "target_of",
    "unresolved",
    "weights_key",
]


class HubError(Exception):
    """The hub refused or could not be asked; `reason` is CamelCase (Unauthorized, NotFound,
    HubUnavailable, SecretNotFound, TokenSecretNotAllowed...), the message names the source."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Hub(Protocol):
    def resolve(self, source: HfSource, *, endpoint: str | None, token: str | None) -> Resolved:
        """`source` at the commit its revision names (raises HubError)."""
        ...


@dataclass(frozen=True, slots=True)
class Seen:
    """The shared objects as the API holds them, and the running pod's progress document."""

    job: Mapping[str, Any] | None = None
    pods: tuple[Mapping[str, Any], ...] = ()
    claim: Mapping[str, Any] | None = None
    progress: FetchStatus | None = None


@dataclass(frozen=True, slots=True)
class WeightsDecision:
    ready: bool  # the workers may be built (an hf:// source is complete and matches the plan)
    condition: Cond
    status: dict[str, Any] | None = None  # status.weights (hf:// only)
    objects: tuple[Obj, ...] = ()  # to apply, in order
    recreate_job: bool = False  # the Job's template changed: delete it (the next one resumes)
    events: tuple[Event, ...] = ()
    target: Target | None = None


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
    marks = events(previous.get("weights") or {}, status, message)
    return WeightsDecision(
        False,
        Cond("WeightsReady", "False", reason, f"spec.model.source: {message}"),
        stamped(status, now),
        events=marks,
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
        status = {**base, "phase": phase, **figures(phase, resolved, progress)}
        if cond.status == "False" and phase == "Failed":
            status["reason"] = cond.reason
        status = throttled(status, before, now)
        if progress is not None:  # the message says what status says (throttled alike)
            cond = replace(cond, message=f"Job {target.job}: {described(status)}")
        marks = events(before, status, cond.message)
        return WeightsDecision(phase == "Ready", cond, status, objects, recreate, marks, target)

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
                    f"{resolved.source.uri} ({gib_text(resolved.total_bytes)} in {resolved.files} "
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
    recreate = live is not None and template_hash(live) != template_hash(job)
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
                f"({gib_text(resolved.total_bytes)}, {resolved.files} files) into claim "
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


# --- helpers ---------------------------------------------------------------------------------


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
            f"{resolved.source.uri} needs {gib_text(resolved.total_bytes)} "
            f"({resolved.files} files)",
        )
    return None
