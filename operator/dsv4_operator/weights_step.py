"""The weights step of a reconcile, for an hf:// source: resolve it through the `Hub` port (a
revision pinned in status is not resolved again), read the token Secret, observe the shared
download objects through the `Kube` and probe ports, and let `weights.decide` choose. No
decisions here beyond which calls to make.

    1. the token: the Secret `spec.model.hub.tokenSecretRef` names (get, this namespace only),
       used only when its owner opted it in (labels.HUB_TOKEN_LABEL): otherwise neither a hub
       request nor the download Job carries it
    2. the commit: status.weights.revision when status.weights.source is the spec's source
       (`@main` resolved once, then pinned), else the hub's answer for the revision
    3. the owners: every DSV4Deployment of the namespace whose status names this download
       (plus this one): each holds a non-controller ownerReference on the shared objects
    4. observe: the Job, its pods, a user's claim, the running pod's GET /progress
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.fetch_status import parse_fetch_status
from dsv4_common.api.model_source import HfSource, is_commit
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, SecretKeyRef
from dsv4_operator import labels as L
from dsv4_operator.kube import Kube, KubeError
from dsv4_operator.weights import (
    Hub,
    HubError,
    Owner,
    Resolved,
    Seen,
    Target,
    fetch_pod_selector,
)


class ProgressProbe(Protocol):
    def progress(self, ip: str) -> Mapping[str, Any] | None:
        """The download pod's GET /progress document; None when it does not answer."""
        ...


@dataclass(frozen=True, slots=True)
class Resolution:
    resolved: Resolved | None = None
    error: HubError | None = None


def resolve_source(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    previous: Mapping[str, Any],
    kube: Kube,
    hub: Hub | None,
    default_endpoint: str | None,
) -> Resolution | None:
    """Steps 1-2; None when the source is not hf://."""
    hf = spec.model.hf
    if hf is None:
        return None
    if hub is None:
        return Resolution(error=HubError("HubUnavailable", f"{hf.uri}: no hub client"))
    try:
        token = read_token(kube, meta.namespace, spec.model.hub.token_secret)
        source = hf.at(pinned) if (pinned := pinned_commit(hf, previous)) else hf
        endpoint = spec.model.hub.endpoint or default_endpoint
        resolved = hub.resolve(source, endpoint=endpoint, token=token)
    except HubError as exc:
        return Resolution(error=exc)
    return Resolution(resolved=replace(resolved, source=hf))


def pinned_commit(hf: HfSource, previous: Mapping[str, Any]) -> str | None:
    """The commit status recorded for this very source, if any."""
    weights = previous.get("weights") or {}
    revision = weights.get("revision")
    if weights.get("source") == hf.uri and isinstance(revision, str) and is_commit(revision):
        return revision
    return None


def read_token(kube: Kube, namespace: str, ref: SecretKeyRef | None) -> str | None:
    if ref is None:
        return None
    where = f"spec.model.hub.tokenSecretRef: Secret {namespace}/{ref.name}"
    try:
        secret = kube.get("v1", "Secret", namespace, ref.name)
    except KubeError as exc:
        if exc.retryable:
            raise
        raise HubError(
            "SecretNotFound", f"{where}: cannot read it: {exc} (the operator needs get on secrets)"
        ) from exc
    if secret is None:
        raise HubError("SecretNotFound", f"{where} not found")
    # Checked before the value is read: whoever may create a DSV4Deployment could otherwise name
    # any Secret of the namespace and have the operator send its key to an endpoint of theirs.
    labels = (secret.get("metadata") or {}).get("labels") or {}
    if labels.get(L.HUB_TOKEN_LABEL) != L.HUB_TOKEN_LABEL_VALUE:
        raise HubError(
            "TokenSecretNotAllowed",
            f"{where} is not opted in as a hub token: its owner must label it "
            f"{L.HUB_TOKEN_LABEL}={L.HUB_TOKEN_LABEL_VALUE} (kubectl -n {namespace} label secret "
            f"{ref.name} {L.HUB_TOKEN_LABEL}={L.HUB_TOKEN_LABEL_VALUE}); the label lets its key "
            "go to the endpoint the CR names",
        )
    raw = (secret.get("data") or {}).get(ref.key)
    if not isinstance(raw, str):
        raise HubError("SecretNotFound", f"{where} has no key {ref.key!r}")
    try:
        return base64.b64decode(raw, validate=True).decode().strip() or None
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise HubError("SecretNotFound", f"{where} key {ref.key!r} is not base64 text") from exc


def owners(kube: Kube, meta: DeploymentMeta, key: str) -> list[Owner]:
    """This DSV4Deployment and every other of its namespace whose status names `key`."""
    found = {meta.uid: meta.name} if meta.uid is not None else {}
    for cr in kube.list(L.API_VERSION, L.KIND, meta.namespace, ""):
        cr_meta = cr.get("metadata") or {}
        uid, name = cr_meta.get("uid"), cr_meta.get("name")
        weights = (cr.get("status") or {}).get("weights") or {}
        if uid and name and weights.get("key") == key and not cr_meta.get("deletionTimestamp"):
            found[str(uid)] = str(name)
    return [Owner(name, uid) for uid, name in sorted(found.items())]


def observe(kube: Kube, probe: ProgressProbe, namespace: str, target: Target) -> Seen:
    """Step 4."""
    jobs = kube.list("batch/v1", "Job", namespace, L.selector_string(_key_label(target)))
    job = next((j for j in jobs if j["metadata"]["name"] == target.job), None)
    selector = L.selector_string(fetch_pod_selector(target.key))
    pods = tuple(kube.list("v1", "Pod", namespace, selector)) if job is not None else ()
    claim = None
    if not target.owned_claim:
        claim = kube.get("v1", "PersistentVolumeClaim", namespace, target.claim)
    progress = None
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        doc = probe.progress(str(ip))
        if doc is None:
            continue
        try:
            progress = parse_fetch_status(json.loads(json.dumps(doc)))
        except DocumentError:
            continue
    return Seen(job=job, pods=pods, claim=claim, progress=progress)


def _key_label(target: Target) -> dict[str, str]:
    return {L.WEIGHTS_KEY_LABEL: target.key}


def stale_objects(
    kube: Kube, meta: DeploymentMeta, key: str, kinds: Sequence[tuple[str, str]]
) -> list[tuple[tuple[str, str, str], Mapping[str, Any]]]:
    """Shared download objects of other keys that this DSV4Deployment still co-owns (a
    revision it moved away from)."""
    selector = L.selector_string({L.APP_MANAGED_BY: L.MANAGED_BY_VALUE})
    out: list[tuple[tuple[str, str, str], Mapping[str, Any]]] = []
    for api_version, kind in kinds:
        for obj in kube.list(api_version, kind, meta.namespace, selector):
            labels = obj["metadata"].get("labels") or {}
            other = labels.get(L.WEIGHTS_KEY_LABEL)
            refs = obj["metadata"].get("ownerReferences") or []
            if other and other != key and any(r.get("uid") == meta.uid for r in refs):
                out.append(((api_version, kind, obj["metadata"]["name"]), obj))
    return out
