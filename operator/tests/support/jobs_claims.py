"""What the API server stores, and refuses, for the kinds of an hf:// source's download: batch/v1
Job, v1 PersistentVolumeClaim and v1 Secret. Restated from kubernetes/kubernetes (read at
pkg/apis/batch/v1/defaults.go SetDefaults_Job, pkg/registry/batch/job/strategy.go
PrepareForCreate/generateSelector, pkg/apis/batch/validation/validation.go
ValidateJobSpecUpdate; pkg/apis/core/v1/defaults.go SetDefaults_PersistentVolumeClaim,
SetDefaults_Secret; pkg/apis/core/validation/validation.go ValidatePersistentVolumeClaimUpdate;
pkg/registry/core/secret/strategy.go, stringData folded into data):

  Job      parallelism 1 and completions 1 (both unset), backoffLimit 6, completionMode
           NonIndexed, suspend false, podReplacementPolicy Failed with a podFailurePolicy
           (else TerminatingOrFailed); the template defaulted as a pod template; a generated
           selector on `batch.kubernetes.io/controller-uid` and the template labelled with it,
           `controller-uid`, `batch.kubernetes.io/job-name` and `job-name`. On update: the
           selector, template, completions and completionMode are immutable (`field is
           immutable`), podFailurePolicy too.
  PVC      volumeMode Filesystem, status.phase Pending; on update the spec is immutable except
           resources.requests (which may only grow) and volumeAttributesClassName.
  Secret   type Opaque; stringData merged into data as base64.
Pure.
"""

from __future__ import annotations

import base64
import copy
from typing import Any, Final

Obj = dict[str, Any]

JOB: Final = ("batch/v1", "Job")
CLAIM: Final = ("v1", "PersistentVolumeClaim")
SECRET: Final = ("v1", "Secret")
CONTROLLER_UID: Final = "batch.kubernetes.io/controller-uid"
JOB_NAME: Final = "batch.kubernetes.io/job-name"
_IMMUTABLE_JOB: Final = (
    "selector",
    "template",
    "completions",
    "completionMode",
    "podFailurePolicy",
)


def default_job(obj: Obj) -> None:
    """Defaults and the generated selector (`obj` has its uid and name)."""
    spec = obj.setdefault("spec", {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault(
        "podReplacementPolicy", "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed"
    )
    meta = obj["metadata"]
    if not spec.get("manualSelector") and "selector" not in spec:
        uid, name = meta["uid"], meta["name"]
        spec["selector"] = {"matchLabels": {CONTROLLER_UID: uid}}
        labels = spec.setdefault("template", {}).setdefault("metadata", {}).setdefault("labels", {})
        labels.update(
            {CONTROLLER_UID: uid, "controller-uid": uid, JOB_NAME: name, "job-name": name}
        )


def default_claim(obj: Obj) -> None:
    obj.setdefault("spec", {}).setdefault("volumeMode", "Filesystem")
    obj.setdefault("status", {}).setdefault("phase", "Pending")


def default_secret(obj: Obj) -> None:
    obj.setdefault("type", "Opaque")
    string_data = obj.pop("stringData", None) or {}
    if string_data:
        data = obj.setdefault("data", {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()


def update_refusal(api_version: str, kind: str, new: Obj, old: Obj) -> str | None:
    """Why an update is invalid (the field and the API server's words), or None."""
    if (api_version, kind) == JOB:
        for field in _IMMUTABLE_JOB:
            was, now = (old.get("spec") or {}).get(field), (new.get("spec") or {}).get(field)
            if field == "template":
                was, now = _without_job_labels(was), _without_job_labels(now)
            if was != now:
                return f"spec.{field}: Invalid value: {now!r}: field is immutable"
        return None
    if (api_version, kind) == CLAIM:
        was, now = copy.deepcopy(old.get("spec") or {}), copy.deepcopy(new.get("spec") or {})
        for spec in (was, now):
            spec.pop("volumeAttributesClassName", None)
            (spec.get("resources") or {}).pop("requests", None)
        if was != now:
            return (
                "spec: Forbidden: spec is immutable after creation except resources.requests and "
                "volumeAttributesClassName for bound claims"
            )
        return None
    return None


def _without_job_labels(template: Any) -> Any:
    if not isinstance(template, dict):
        return template
    out = copy.deepcopy(template)
    labels = (out.get("metadata") or {}).get("labels") or {}
    for key in (CONTROLLER_UID, "controller-uid", JOB_NAME, "job-name"):
        labels.pop(key, None)
    return out
