"""A loopback, in-memory Kubernetes API server that speaks the REST wire protocol: enough of it
for the official client's DynamicClient (what `ApiKube` uses) and for kopf running our handlers.

What it serves (HTTP, 127.0.0.1 only):
  discovery  /version, /api, /api/v1, /apis, /apis/{group}/{version} (APIResourceList with
             verbs, short names and `<plural>/status` subresources)
  objects    get, list (labelSelector, fieldSelector on metadata.name/namespace; `limit` and
             `continue` pages), watch (chunked JSON lines; resourceVersion start,
             timeoutSeconds, sendInitialEvents; 410 Gone from a compacted version),
             create (generateName, 409 AlreadyExists, 404 for a missing namespace), replace,
             patch (merge, JSON patch with `test`, strategic merge for built-in kinds and
             415 for custom resources, server-side apply), the status subresource, delete
             (finalizers: deletionTimestamp first, gone when the last finalizer goes;
             owner-reference garbage collection, also of a dependent created after its owner
             is gone) and deletecollection.
  kinds      v1 Namespace/Pod/Service/ConfigMap/ServiceAccount/Secret/Event/PersistentVolumeClaim,
             batch/v1 Job (defaults, update refusals: support/jobs_claims.py), apps/v1
             StatefulSet and Deployment, policy/v1 PodDisruptionBudget, networking.k8s.io/v1
             NetworkPolicy, apiextensions.k8s.io/v1 CustomResourceDefinition,
             rbac.authorization.k8s.io/v1 Role/RoleBinding/ClusterRole/ClusterRoleBinding,
             plus every CRD created (served at once, then reported NamesAccepted and
             Established; `kubectl get` of its kind answered as a Table of its printer
             columns, support/printer_table.py).

Refused as the real server refuses (support/object_meta.py): ObjectMeta on every write (names
by the kind's rule: DNS-1123 subdomains, DNS-1035 labels for Services, DNS-1123 labels for
Namespaces; label keys and values; annotation keys and their total size, 256 KiB), a body past
3 MiB (413), and a create in a terminating namespace (403 Forbidden, cause NamespaceTerminating:
a deleted Namespace terminates until `finish_namespace`, the test playing the namespace
controller, has emptied it).

As the real server does: one global resourceVersion counter; uid, creationTimestamp and
generation are server-set (generation moves when anything outside metadata and status
changes); writes to a kind with a status subresource ignore `status` on the main resource and
only `status` on `/status`; no-op writes change nothing; list items of built-in kinds carry no
apiVersion/kind (kubernetes/kubernetes#3030), items of custom resources do; errors are
`Status` objects. Built-in kinds are stored as decoded into their Go types and defaulted
(support/builtin_defaults.py: canonical quantities, support/quantity_canon.py). Every write
keeps managedFields and server-side apply merges, prunes and refuses conflicts as the real
server does (support/ssa.py, over support/field_sets.py and the schema facts of
support/field_types.py); strategic merge patches follow support/strategic_merge.py.
Admission hooks (defaulting, validation) can be installed per resource, and so can validating
webhooks (`Webhook`): as the real server does, it POSTs an AdmissionReview v1
over HTTPS (the webhook's certificate verified against a CA) for each create or update of the
main resource and refuses the write with the webhook's message and code, or with 500 when the
call fails and the failure policy is Fail; webhook warnings come back as `Warning` headers. It
asks outside its lock, so a webhook may read from this server. `?dryRun=All` runs everything
(admission and webhooks included) and stores nothing.

Authorization: a request with a bearer token from `service_account_token` is that
ServiceAccount's and is authorized by the RBAC objects stored here (support/rbac.py: 403
otherwise, worded as the real server words it), and its writes pass the
OwnerReferencesPermissionEnforcement plugin (support/owner_refs_admission.py); a request
without credentials is the cluster admin's (system:masters), as the tests' own are. History:
`compact()` (or `history_window`) forgets events, so watches and continue tokens from before
answer 410 (support/watch_cache.py); `close_watches()` ends the open streams.

For tests: `requests` logs every request (method, path, query, content type, parsed body, and
the response code: 0 while in flight, set in the same hold of the lock as the request's effect);
`fail_next` makes the next matching request fail with a given code; `hold` hangs matching
requests until released; the object helpers
(`create`, `get`, `list`, `set_status`, `delete`) act as a controller or kubelet would
(and show up in watches); `write_kubeconfig` points a client at the server.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import random
import re
import socket
import ssl
import string
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import yaml
from aiohttp import web
from support import (
    builtin_defaults,
    crd_rules,
    jobs_claims,
    object_meta,
    owner_refs_admission,
    quantity_canon,
    rbac,
    ssa,
    strategic_merge,
    watch_cache,
)
from support import field_sets as fs
from support import field_types as ft
from support.printer_table import printer_columns, table, wants_table

Obj = dict[str, Any]
Admission = Callable[[Obj], Obj]  # returns the (defaulted) object or raises AdmissionError

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
MAX_REQUEST_BODY_BYTES: Final = 3 * 1024 * 1024


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------
# Resource types


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    custom: bool = False  # a custom resource: list items keep apiVersion/kind

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def discovery(self) -> list[Obj]:
        main: Obj = {
            "name": self.plural,
            "singularName": self.singular or self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(ALL_VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        out = [main]
        if self.status_subresource:
            out.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        return out


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", False, short_names=("ns",),
                 status_subresource=True),
    ResourceType("", "v1", "pods", "Pod", True, short_names=("po",), status_subresource=True),
    ResourceType("", "v1", "services", "Service", True, short_names=("svc",),
                 status_subresource=True),
    ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
    ResourceType("", "v1", "secrets", "Secret", True),
    ResourceType("", "v1", "events", "Event", True, short_names=("ev",)),
    ResourceType("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True,
                 short_names=("pvc",), status_subresource=True),
    ResourceType("batch", "v1", "jobs", "Job", True, status_subresource=True),
    ResourceType("apps", "v1", "statefulsets", "StatefulSet", True, short_names=("sts",),
                 status_subresource=True),
    ResourceType("apps", "v1", "deployments", "Deployment", True, short_names=("deploy",),
                 status_subresource=True),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True,
                 short_names=("pdb",), status_subresource=True),
    ResourceType("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True,
                 short_names=("netpol",)),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions",
                 "CustomResourceDefinition", False, short_names=("crd", "crds"),
                 status_subresource=True),
    ResourceType(rbac.RBAC_GROUP, "v1", "clusterroles", "ClusterRole", False),
    ResourceType(rbac.RBAC_GROUP, "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    ResourceType(rbac.RBAC_GROUP, "v1", "roles", "Role", True),
    ResourceType(rbac.RBAC_GROUP, "v1", "rolebindings", "RoleBinding", True),
)  # fmt: skip


def crd_types(crd: Mapping[str, Any]) -> list[ResourceType]:
    spec, names = crd["spec"], crd["spec"]["names"]
    return [
        ResourceType(
            spec["group"],
            version["name"],
            names["plural"],
            names["kind"],
            spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular", names["kind"].lower()),
            short_names=tuple(names.get("shortNames", ())),
            categories=tuple(names.get("categories", ())),
            status_subresource="status" in (version.get("subresources") or {}),
            custom=True,
        )
        for version in spec["versions"]
        if version.get("served", True)
    ]


# ---------------------------------------------------------------------------------------------
# Errors


_REASONS: Final = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Gone",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        *,
        details: Obj | None = None,
        list_meta: Obj | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details  # Status.details: name, group, kind (the resource)
        self.list_meta = list_meta  # Status.metadata: an expired list's `continue`

    def status(self) -> Obj:
        status: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": dict(self.list_meta or {}),
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            status["details"] = dict(self.details)
        return status

    def response(self) -> web.Response:
        return web.json_response(self.status(), status=self.code)


class AdmissionError(Exception):
    """Raised by an admission hook: the write is refused with 422 Invalid."""

    def __init__(self, messages: Iterable[str]) -> None:
        self.messages = list(messages)
        super().__init__("; ".join(self.messages))


@dataclass(frozen=True)
class Webhook:
    """One validating webhook of a ValidatingWebhookConfiguration, with a `url` clientConfig
    (rules: the main resource it is added for, these operations)."""

    name: str
    url: str
    ca_file: Path  # the CA bundle the webhook's serving certificate is verified against
    operations: tuple[str, ...] = ("CREATE", "UPDATE")
    failure_policy: str = "Fail"  # "Ignore": a webhook that cannot be called admits
    timeout_s: float = 10.0
    # Its matchConditions, as a predicate on the AdmissionReview's request (None: all match).
    match: Callable[[Obj], bool] | None = None


@dataclass(frozen=True)
class WebhookAnswer:
    allowed: bool
    code: int = 200
    message: str = ""
    reason: str = ""
    warnings: tuple[str, ...] = ()


def call_webhook(webhook: Webhook, review: Obj) -> WebhookAnswer:
    """POST an AdmissionReview to the webhook as the API server does; a refusal reads as the
    server words it, and a failed call is refused or admitted per the failure policy."""
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    post = urllib.request.Request(
        webhook.url,
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(post, timeout=webhook.timeout_s, context=context) as rsp:
            response = json.loads(rsp.read())["response"]
        if response.get("uid") != review["request"]["uid"]:
            raise ValueError(f"expected response.uid={review['request']['uid']!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # URL, TLS, HTTP, JSON errors
        if webhook.failure_policy == "Ignore":
            return WebhookAnswer(True)
        message = f'Internal error occurred: failed calling webhook "{webhook.name}": {exc}'
        return WebhookAnswer(False, 500, message, "InternalError")
    warnings = tuple(str(w) for w in response.get("warnings") or ())
    if response.get("allowed") is True:
        return WebhookAnswer(True, warnings=warnings)
    status = response.get("status") or {}
    code = max(int(status.get("code") or 0), 400)  # never a refusal below 400
    denied = f'admission webhook "{webhook.name}" denied the request'
    text = status.get("message") or status.get("reason")
    message = f"{denied}: {text}" if text else f"{denied} without explanation"
    return WebhookAnswer(False, code, message, status.get("reason") or "", warnings)


class _AskWebhook(Exception):
    """Raised under the lock by a write that needs a webhook's answer first. The caller asks
    outside the lock and serves the request again; the answer is found by `key` (the request
    without what the server sets anew on each attempt)."""

    def __init__(self, webhook: Webhook, review: Obj, key: str) -> None:
        super().__init__(webhook.name)
        self.webhook, self.review, self.key = webhook, review, key


_MAX_WEBHOOK_ROUNDS: Final = 8

# The PATCH content types the server accepts, in the order its 415 lists them.
_PATCH_TYPES_BUILTIN: Final = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)
_PATCH_TYPES_CUSTOM: Final = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/apply-patch+yaml",
)


def _invalid_patch_options(message: str) -> ApiError:
    """validation.ValidatePatchOptions' refusal (422, as errors.NewInvalid words it)."""
    return ApiError(422, f'PatchOptions.meta.k8s.io "" is invalid: {message}')


# ---------------------------------------------------------------------------------------------
# Label selectors and patches (pure)

_REQUIREMENT = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9._/-]+)\s*"
    r"(?:(?P<op>==|!=|=|\s+in\s+|\s+notin\s+)\s*(?P<value>\([^)]*\)|[A-Za-z0-9._-]*))?\s*$"
)


def _split_selector(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Kubernetes label selector syntax: k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b)."""
    for part in _split_selector(selector):
        m = _REQUIREMENT.match(part)
        if m is None:
            raise ApiError(400, f"unable to parse requirement: {part!r}")
        key, op, value = m["key"], (m["op"] or "").strip(), m["value"]
        if m["neg"]:
            if op:
                raise ApiError(400, f"unable to parse requirement: {part!r}")
            if key in labels:
                return False
        elif not op:
            if key not in labels:
                return False
        elif op in ("=", "=="):
            if labels.get(key) != value:
                return False
        elif op == "!=":
            if labels.get(key) == value:
                return False
        else:
            values = {v.strip() for v in (value or "").strip("()").split(",") if v.strip()}
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and labels.get(key) in values:
                return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _container(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, list):
            doc = doc[int(part)]
        elif isinstance(doc, dict):
            doc = doc[part]
        else:
            raise KeyError(part)
    return doc


def json_patch(doc: Any, ops: list[Mapping[str, Any]]) -> Any:
    """RFC 6902 JSON patch; a failed `test` or a missing path is 422 (as the API server says)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(str(op.get("path", "")))
        try:
            if kind == "test":
                if _container(doc, parts) != op.get("value"):
                    raise ApiError(422, f"the server rejected our request: test failed at {op}")
                continue
            if kind in ("move", "copy"):
                src = _pointer(str(op["from"]))
                value = copy.deepcopy(_container(doc, src))
                if kind == "move":
                    parent = _container(doc, src[:-1])
                    parent.pop(int(src[-1]) if isinstance(parent, list) else src[-1])
                kind, op = "add", {"value": value}
            if not parts:
                if kind in ("add", "replace"):
                    doc = copy.deepcopy(op["value"])
                    continue
                raise ApiError(422, "cannot remove the root")
            parent = _container(doc, parts[:-1])
            last = parts[-1]
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, copy.deepcopy(op["value"]))
                elif kind == "replace":
                    parent[index] = copy.deepcopy(op["value"])
                elif kind == "remove":
                    parent.pop(index)
                else:
                    raise ApiError(422, f"unknown JSON patch op {kind!r}")
            elif isinstance(parent, dict):
                if kind == "add":
                    parent[last] = copy.deepcopy(op["value"])
                elif kind == "replace":
                    if last not in parent:
                        raise KeyError(last)
                    parent[last] = copy.deepcopy(op["value"])
                elif kind == "remove":
                    del parent[last]
                else:
                    raise ApiError(422, f"unknown JSON patch op {kind!r}")
            else:
                raise KeyError(last)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, f"JSON patch {op} cannot be applied: {exc!r}") from exc
    return doc


def _stable(obj: Obj | None) -> Obj | None:
    """The object without what the server sets anew on each attempt of one write."""
    if obj is None:
        return None
    meta = {
        k: v
        for k, v in (obj.get("metadata") or {}).items()
        if k not in ("uid", "creationTimestamp", "resourceVersion", "managedFields", "generation")
    }
    return {**obj, "metadata": meta}


# ---------------------------------------------------------------------------------------------
# The server


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any
    code: int = 0  # the response's status code
    warnings: list[str] = field(default_factory=list)  # sent as Warning headers (webhooks')
    user: str = ""  # who made it (rbac.ADMIN without credentials)
    cause: str = ""  # a refusal's first Status cause (e.g. NamespaceTerminating)
    at: float = field(default_factory=time.monotonic)  # when it arrived


@dataclass
class Hold:
    """Requests matching `method` and containing `path` wait, unanswered, until `release`
    is set (`arrived` is set when the first one does): an API server that hangs."""

    method: str
    path: str
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Failure:
    code: int
    method: str | None
    path: str | None  # a substring of the path
    reason: str | None
    message: str
    times: int


@dataclass
class _Event:
    rv: int
    type: str
    rtype: ResourceType
    obj: Obj
    old: Obj | None


@dataclass
class _Watch:
    rtype: ResourceType
    namespace: str | None
    name: str | None
    selector: str
    queue: asyncio.Queue[_Event | None]
    loop: asyncio.AbstractEventLoop


@dataclass
class _WatchTarget:
    rtype: ResourceType
    namespace: str | None


@dataclass
class _Stored:
    rtype: ResourceType
    obj: Obj


Key = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-scoped), name


class FakeApiServer:
    """Start with `start()` (or as a context manager); `url` is http://127.0.0.1:<port>."""

    def __init__(
        self,
        crds: Iterable[Mapping[str, Any]] = (),
        *,
        namespaces: Iterable[str] = ("default",),
        history_window: int | None = None,
        crd_admission: Callable[[Obj], Admission] | None = None,
    ) -> None:
        """`history_window`: watch events kept (None: all until `compact`); `crd_admission`:
        the admission hook (schema, CEL) for the kinds of each CRD created, from the CRD."""
        self.requests: list[Request] = []
        self._lock = threading.RLock()
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._objects: dict[Key, _Stored] = {}
        self._history = watch_cache.History[_Event](history_window)
        self._pages = watch_cache.Pages()
        self._crd_admission = crd_admission
        # Bearer tokens -> users; a request without credentials is the cluster admin's (the
        # test's own). `_user`: who makes the request being served (under the lock).
        self._tokens: dict[str, rbac.User] = {}
        self._user = rbac.ADMIN
        self._watches: list[_Watch] = []
        self._failures: list[_Failure] = []
        self._holds: list[Hold] = []
        self._admission: dict[tuple[str, str], Admission] = {}
        self._webhooks: dict[tuple[str, str], list[Webhook]] = {}
        self._answers: dict[str, WebhookAnswer] = {}  # webhook answers, asked outside the lock
        self._dry_run = False  # the request being served (under the lock) is a dry run
        self._warnings: list[str] = []  # webhook warnings for the request being served
        self._rv = itertools.count(1)
        self._last_rv = 0
        self._uids = itertools.count(1)
        self._service_ips: dict[tuple[str, str], str] = {}  # ClusterIPs, from 10.96.0.0/12
        self._crd_types: dict[tuple[str, str], ft.FieldType] = {}  # (CRD uid/rv, version)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self.port = 0
        for rtype in BUILTIN_TYPES:
            self._types[(rtype.group, rtype.version, rtype.plural)] = rtype
        self._admission[("apiextensions.k8s.io", "customresourcedefinitions")] = _admit_crd
        self._admission[("", "secrets")] = _admit_secret
        for crd in crds:
            self.add_crd(crd)
        for ns in namespaces:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    # --- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeApiServer:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        started = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._serve, args=(started,), name="fake-apiserver", daemon=True
        )
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the fake API server did not start")
        return self

    def _serve(self, started: threading.Event) -> None:
        loop = self._loop
        assert loop is not None and self._sock is not None
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True,
            shutdown_timeout=1.0,
        )  # fmt: skip
        loop.run_until_complete(self._runner.setup())
        loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def stop(self) -> None:
        """Ends every watch, closes the port and joins the server thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with self._lock:
            for watch in self._watches:
                watch.loop.call_soon_threadsafe(watch.queue.put_nowait, None)
            for held in self._holds:
                held.release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(15)
        if self._sock is not None:
            self._sock.close()
        self._loop = self._thread = None

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def write_kubeconfig(
        self, path: Path, namespace: str = "default", token: str | None = None
    ) -> Path:
        """A kubeconfig for this server; with `token`, its requests are that user's."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token} if token else {}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # --- authentication, compaction --------------------------------------------------------
    def service_account_token(self, namespace: str, name: str) -> str:
        """A bearer token that authenticates as the ServiceAccount `namespace/name`; its
        requests are authorized by the RBAC objects stored here (Roles, bindings...)."""
        token = f"sa-{namespace}-{name}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            self._tokens[token] = rbac.service_account_user(namespace, name)
        return token

    def compact(self, rv: int | None = None) -> int:
        """Forget the history up to `rv` (default: now), as etcd's compaction does: a watch
        resuming from an older resourceVersion, or a list continuing from one, gets 410."""
        with self._lock:
            upto = self._last_rv if rv is None else rv
            self._history.compact(upto)
            self._pages.forget_before(upto)
            return upto

    def close_watches(self) -> None:
        """End every open watch, as the server does when a watch's timeout is up: clients
        reconnect from the last resourceVersion they saw."""
        with self._lock:
            for watch in self._watches:
                watch.loop.call_soon_threadsafe(watch.queue.put_nowait, None)

    def _authenticated(self, request: web.Request) -> rbac.User:
        """Who makes this request (call with the lock held): 401 for an unknown token."""
        header = request.headers.get("Authorization", "")
        if not header:
            return rbac.ADMIN
        user = self._tokens.get(header.removeprefix("Bearer ").strip())
        if user is None or not header.startswith("Bearer "):
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def _authorize(self, user: rbac.User, request: web.Request, query: dict[str, str]) -> None:
        """403, shaped as the real server's Status, unless RBAC allows the request."""
        if rbac.MASTERS in user.groups:
            return
        attrs = rbac.request_attributes(request.method, request.path, query)
        allowed, reason = rbac.authorize(self._policy(), user, attrs)
        if not allowed:
            raise ApiError(
                403,
                rbac.forbidden_message(user, attrs, reason),
                "Forbidden",
                details={"name": attrs.name, "group": attrs.api_group, "kind": attrs.resource},
            )

    def _policy(self) -> rbac.Policy:
        return rbac.Policy.from_objects(
            s.obj for (group, *_), s in self._objects.items() if group == rbac.RBAC_GROUP
        )

    def _resource_of(self, api_version: str, kind: str) -> tuple[str, str] | None:
        try:
            rtype = self.rtype(api_version, kind)
        except KeyError:
            return None
        return rtype.group, rtype.plural

    def _enforce_owner_references(
        self, rtype: ResourceType, obj: Obj, old: Obj | None, subresource: str | None
    ) -> None:
        """OwnerReferencesPermissionEnforcement (support/owner_refs_admission.py)."""
        if rbac.MASTERS in self._user.groups:
            return
        meta = obj.get("metadata") or {}
        write = rbac.Attributes(
            "",
            "",
            True,
            api_group=rtype.group,
            api_version=rtype.version,
            namespace=meta.get("namespace", "") if rtype.namespaced else "",
            resource=rtype.plural,
            subresource=subresource or "",
            name=meta.get("name", ""),
        )
        refused = owner_refs_admission.refusal(
            self._user, self._policy(), write, obj, old, self._resource_of
        )
        if refused:
            raise ApiError(403, refused, "Forbidden")

    # --- configuration ---------------------------------------------------------------------
    def add_crd(self, crd: Mapping[str, Any]) -> None:
        """Create the CRD (refused as the real server refuses it), then serve its kinds."""
        self.create(copy.deepcopy(dict(crd)))
        for rtype in crd_types(crd):
            self._types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def add_admission(self, api_version: str, kind: str, hook: Admission) -> None:
        rtype = self.rtype(api_version, kind)
        self._admission[(rtype.group, rtype.plural)] = hook

    def add_webhook(self, api_version: str, kind: str, webhook: Webhook) -> None:
        rtype = self.rtype(api_version, kind)
        with self._lock:
            self._webhooks.setdefault((rtype.group, rtype.plural), []).append(webhook)

    def fail_next(
        self,
        code: int,
        *,
        method: str | None = None,
        path: str | None = None,
        reason: str | None = None,
        message: str = "injected failure",
        times: int = 1,
    ) -> None:
        """The next `times` requests matching `method` and containing `path` fail with `code`."""
        with self._lock:
            self._failures.append(
                _Failure(code, method.upper() if method else None, path, reason, message, times)
            )

    def hold(self, method: str, path: str) -> Hold:
        """Hang every request matching `method` and containing `path` until released."""
        held = Hold(method.upper(), path)
        with self._lock:
            self._holds.append(held)
        return held

    def clear_requests(self) -> None:
        """Forget the requests logged so far (an install's, before the test's own)."""
        with self._lock:
            self.requests.clear()

    def requests_to(self, method: str | None = None, path: str | None = None) -> list[Request]:
        """Logged requests with this method whose path contains `path`."""
        with self._lock:
            logged = list(self.requests)
        return [
            r
            for r in logged
            if (method is None or r.method == method.upper()) and (path is None or path in r.path)
        ]

    def rtype(self, api_version: str, kind: str) -> ResourceType:
        for rtype in self._types.values():
            if rtype.api_version == api_version and rtype.kind == kind:
                return rtype
        raise KeyError(f"{api_version} {kind} is not served")

    # --- object helpers (the test acting as a controller or kubelet) ------------------------
    def create(self, obj: Mapping[str, Any], *, keep_status: bool = True) -> Obj:
        rtype = self.rtype(obj["apiVersion"], obj["kind"])
        ns = obj["metadata"].get("namespace", "") if rtype.namespaced else ""
        for _ in range(_MAX_WEBHOOK_ROUNDS):
            with self._lock:
                try:
                    return self._create(
                        rtype, ns, copy.deepcopy(dict(obj)), keep_status=keep_status
                    )
                except _AskWebhook as ask:
                    pending = ask
            answer = call_webhook(pending.webhook, pending.review)
            with self._lock:
                self._answers[pending.key] = answer
        raise ApiError(500, "the object kept changing while webhooks were asked")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        rtype = self.rtype(api_version, kind)
        with self._lock:
            stored = self._objects.get(self._key(rtype, namespace, name))
            return copy.deepcopy(stored.obj) if stored else None

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, selector: str = ""
    ) -> list[Obj]:
        rtype = self.rtype(api_version, kind)
        with self._lock:
            return [copy.deepcopy(o) for o in self._select(rtype, namespace, None, selector)]

    def set_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Obj:
        """Replace the status (as a controller writing the status subresource)."""
        rtype = self.rtype(api_version, kind)
        with self._lock:
            live = self._require(rtype, namespace, name)
            new = {**copy.deepcopy(live), "status": copy.deepcopy(dict(status))}
            return self._update(rtype, live, new, "status", "test")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> Obj:
        rtype = self.rtype(api_version, kind)
        with self._lock:
            return self._delete(rtype, namespace, name, "Background")

    # --- store (call with the lock held) -----------------------------------------------------
    @staticmethod
    def _key(rtype: ResourceType, namespace: str | None, name: str) -> Key:
        return (rtype.group, rtype.plural, namespace or "" if rtype.namespaced else "", name)

    def _next_rv(self) -> str:
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    def _require(self, rtype: ResourceType, namespace: str, name: str) -> Obj:
        stored = self._objects.get(self._key(rtype, namespace, name))
        if stored is None:
            raise ApiError(404, f'{rtype.plural}.{rtype.group or "core"} "{name}" not found')
        return stored.obj

    def _emit(self, kind: str, rtype: ResourceType, obj: Obj, old: Obj | None) -> None:
        event = _Event(int(obj["metadata"]["resourceVersion"]), kind, rtype, obj, old)
        self._history.append(event)
        for watch in self._watches:
            if watch.rtype == rtype:
                watch.loop.call_soon_threadsafe(watch.queue.put_nowait, event)

    def _admit(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj | None = None,
        operation: str = "CREATE",
        subresource: str | None = None,
    ) -> Obj:
        """ObjectMeta's validation, the admission hook (defaults, schema), then the validating
        webhooks (main resource only): the object to store, or ApiError."""
        meta = obj.get("metadata") or {}
        invalid = object_meta.meta_errors(rtype.group, rtype.plural, meta)
        if invalid:
            message = object_meta.invalid_message(
                rtype.group, rtype.kind, str(meta.get("name", "")), invalid
            )
            raise ApiError(422, message, "Invalid")
        hook = self._admission.get((rtype.group, rtype.plural))
        if hook is not None:
            try:
                obj = hook(copy.deepcopy(obj))
            except AdmissionError as exc:
                name = obj.get("metadata", {}).get("name", "")
                raise ApiError(
                    422,
                    f'{rtype.kind}.{rtype.group} "{name}" is invalid: {"; ".join(exc.messages)}',
                ) from exc
        self._enforce_owner_references(rtype, obj, old, subresource)
        if subresource is None:
            for webhook in self._webhooks.get((rtype.group, rtype.plural), ()):
                if operation in webhook.operations:
                    self._ask(webhook, rtype, operation, obj, old)
        return obj

    def _ask(
        self, webhook: Webhook, rtype: ResourceType, operation: str, obj: Obj, old: Obj | None
    ) -> None:
        """Apply the webhook's answer to this request, or raise _AskWebhook to get it."""
        review = self._review(rtype, operation, obj, old)
        if webhook.match is not None and not webhook.match(review["request"]):
            return
        stable = [webhook.name, operation, _stable(obj), _stable(old), self._dry_run]
        key = json.dumps(stable, sort_keys=True)
        answer = self._answers.pop(key, None)
        if answer is None:
            raise _AskWebhook(webhook, review, key)
        self._warnings.extend(answer.warnings)
        if not answer.allowed:
            raise ApiError(answer.code, answer.message, answer.reason or None)

    def _review(self, rtype: ResourceType, operation: str, obj: Obj, old: Obj | None) -> Obj:
        meta = obj.get("metadata") or {}
        kind = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}
        resource = {"group": rtype.group, "version": rtype.version, "resource": rtype.plural}
        options = "CreateOptions" if operation == "CREATE" else "UpdateOptions"
        request: Obj = {
            "uid": str(uuid.uuid4()),
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": meta.get("name", ""),
            "operation": operation,
            "userInfo": {"username": "fake-apiserver-client", "groups": ["system:authenticated"]},
            "object": copy.deepcopy(obj),
            "oldObject": copy.deepcopy(old),
            "dryRun": self._dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": options},
        }
        if rtype.namespaced:
            request["namespace"] = meta.get("namespace", "")
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}

    def _create(
        self,
        rtype: ResourceType,
        namespace: str,
        obj: Obj,
        *,
        keep_status: bool,
        manager: str = "",
        managed: list[ssa.Entry] | None = None,
    ) -> Obj:
        """Store a new object. `manager`: who creates it (an Update in managedFields; none: not
        tracked); `managed`: its managedFields entries instead (a create by apply)."""
        meta = obj.setdefault("metadata", {})
        if rtype.namespaced:
            if not namespace:
                raise ApiError(400, "the namespace of the object does not match the request")
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(400, "the namespace of the provided object does not match")
            ns_obj = self._objects.get(("", "namespaces", "", namespace))
            if not ns_obj:
                raise ApiError(404, f'namespaces "{namespace}" not found')
            if ns_obj.obj["metadata"].get("deletionTimestamp"):  # NamespaceLifecycle
                name = meta.get("name") or meta.get("generateName", "")
                message, details = object_meta.terminating_refusal(
                    rtype.group, rtype.plural, name, namespace
                )
                raise ApiError(403, message, "Forbidden", details=details)
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "name or generateName is required")
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            meta["name"] = meta["generateName"] + suffix
        key = self._key(rtype, namespace, meta["name"])
        if key in self._objects:
            raise ApiError(
                409,
                f'{rtype.plural}.{rtype.group or "core"} "{meta["name"]}" already exists',
                "AlreadyExists",
            )
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        if rtype.status_subresource and not keep_status:
            obj.pop("status", None)
        for server_set in ("resourceVersion", "deletionTimestamp", "managedFields"):
            meta.pop(server_set, None)
        meta["uid"] = f"00000000-0000-4000-8000-{next(self._uids):012d}"
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        obj = self._admit(rtype, self._decode(rtype, obj, None))
        if managed is None and manager:
            managed = self._track_update(rtype, None, obj, obj, [], manager, None)
        if managed:
            obj["metadata"]["managedFields"] = ssa.encode(managed)
        if self._dry_run:
            return copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._objects[key] = _Stored(rtype, obj)
        self._emit("ADDED", rtype, copy.deepcopy(obj), None)
        created = copy.deepcopy(obj)
        if (rtype.group, rtype.plural) == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._establish(rtype, key)
        self._collect_if_orphaned(key)
        return created

    def _establish(self, rtype: ResourceType, key: Key) -> None:
        """apiextensions-apiserver's controllers, at once: the CRD's kinds are served (with
        `crd_admission`'s hook), then its status says NamesAccepted and Established
        (pkg/controller/status/naming_controller.go, establish/establishing_controller.go)."""
        crd = self._objects[key].obj
        for served in crd_types(crd):
            self._types[(served.group, served.version, served.plural)] = served
            if self._crd_admission is not None:
                hook = self._crd_admission(crd)
                self._admission.setdefault((served.group, served.plural), hook)
        spec = crd["spec"]
        status = {
            "acceptedNames": copy.deepcopy(spec["names"]),
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now_rfc3339()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted",
                 "lastTransitionTime": now_rfc3339()},
            ],
        }  # fmt: skip
        user, self._user = self._user, rbac.ADMIN  # the server's own controllers write it
        try:
            self._update(rtype, crd, {**crd, "status": status}, "status", "kube-apiserver")
        finally:
            self._user = user

    def _collect_if_orphaned(self, key: Key) -> None:
        """The garbage collector's other half: a dependent created after every owner it names
        is gone is deleted (the real collector does so asynchronously, soon after). A
        reconcile that read its CR just before the CR went away can apply children late."""
        stored = self._objects[key]
        refs = stored.obj["metadata"].get("ownerReferences") or []
        if not refs:
            return
        uids = {s.obj["metadata"]["uid"] for s in self._objects.values()}
        if not any(r.get("uid") in uids for r in refs):
            self._delete(stored.rtype, key[2], key[3], "Background")

    def _update(
        self,
        rtype: ResourceType,
        live: Obj,
        new: Obj,
        subresource: str | None,
        manager: str,
        *,
        precondition_rv: str | None = None,
        managed: list[ssa.Entry] | None = None,
    ) -> Obj:
        """Store `new` as the next version of `live` (both full objects): `manager`'s write
        (an Update in managedFields), or an apply's with its entries `managed`."""
        meta_live = live["metadata"]
        if precondition_rv and precondition_rv != meta_live["resourceVersion"]:
            raise ApiError(
                409,
                f'Operation cannot be fulfilled on {rtype.plural} "{meta_live["name"]}": the '
                "object has been modified; please apply your changes to the latest version and "
                "try again",
            )
        if subresource == "status":
            out = copy.deepcopy(live)
            if "status" in new:
                out["status"] = copy.deepcopy(new["status"])
            else:
                out.pop("status", None)
        else:
            out = copy.deepcopy(new)
            out["apiVersion"], out["kind"] = rtype.api_version, rtype.kind
            if rtype.status_subresource:
                if "status" in live:
                    out["status"] = copy.deepcopy(live["status"])
                else:
                    out.pop("status", None)
            meta = out.setdefault("metadata", {})
            for server_set in ("name", "namespace", "uid", "creationTimestamp", "generation"):
                if server_set in meta_live:
                    meta[server_set] = meta_live[server_set]
                else:
                    meta.pop(server_set, None)
            if "deletionTimestamp" in meta_live:
                meta["deletionTimestamp"] = meta_live["deletionTimestamp"]
                # No new finalizers on an object being deleted.
                kept = set(meta_live.get("finalizers") or [])
                meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f in kept]
            else:
                meta.pop("deletionTimestamp", None)
            if not meta.get("finalizers"):
                meta.pop("finalizers", None)
        out = self._admit(rtype, self._decode(rtype, out, live), live, "UPDATE", subresource)
        if (
            subresource is None
            and (why := jobs_claims.update_refusal(rtype.api_version, rtype.kind, out, live))
            is not None
        ):
            raise ApiError(
                422, f'{rtype.kind}.{rtype.group or "core"} "{meta_live["name"]}" is invalid: {why}'
            )
        out["metadata"]["resourceVersion"] = meta_live["resourceVersion"]
        before = ssa.decode(meta_live.get("managedFields") or []) or []
        if managed is None:
            managed = self._track_update(rtype, live, new, out, before, manager, subresource)
        out["metadata"].pop("managedFields", None)
        if ssa.without_managed_fields(live) == out and ssa.same_ignoring_times(managed, before):
            return copy.deepcopy(live)  # a no-op write changes nothing, not even the version
        if managed:
            out["metadata"]["managedFields"] = ssa.encode(managed)

        def content(o: Obj) -> Obj:
            return {k: v for k, v in o.items() if k not in ("metadata", "status")}

        if content(out) != content(live):
            out["metadata"]["generation"] = int(meta_live.get("generation", 1)) + 1
        if self._dry_run:
            return copy.deepcopy(out)
        out["metadata"]["resourceVersion"] = self._next_rv()
        key = self._key(rtype, meta_live.get("namespace"), meta_live["name"])
        if out["metadata"].get("deletionTimestamp") and not out["metadata"].get("finalizers"):
            return self._remove(key, out)
        self._objects[key].obj = out
        self._emit("MODIFIED", rtype, copy.deepcopy(out), copy.deepcopy(live))
        return copy.deepcopy(out)

    def _remove(self, key: Key, last: Obj) -> Obj:
        stored = self._objects.pop(key)
        self._emit("DELETED", stored.rtype, copy.deepcopy(last), None)
        # Garbage collection: dependents of the removed owner go too (background propagation).
        uid = last["metadata"]["uid"]
        for dep_key, dep in list(self._objects.items()):
            refs = dep.obj["metadata"].get("ownerReferences") or []
            if dep_key in self._objects and any(r.get("uid") == uid for r in refs):
                self._delete(dep.rtype, dep_key[2], dep_key[3], "Background")
        return copy.deepcopy(last)

    def _delete(self, rtype: ResourceType, namespace: str, name: str, propagation: str) -> Obj:
        live = self._require(rtype, namespace, name)
        key = self._key(rtype, namespace, name)
        if (rtype.group, rtype.plural) == ("", "namespaces"):
            return self._terminate_namespace(key, live)
        if live["metadata"].get("finalizers"):
            if live["metadata"].get("deletionTimestamp"):
                return copy.deepcopy(live)
            out = copy.deepcopy(live)
            out["metadata"]["deletionTimestamp"] = now_rfc3339()
            out["metadata"]["deletionGracePeriodSeconds"] = 0
            out["metadata"]["resourceVersion"] = self._next_rv()
            self._objects[key].obj = out
            self._emit("MODIFIED", rtype, copy.deepcopy(out), copy.deepcopy(live))
            return copy.deepcopy(out)
        out = copy.deepcopy(live)
        out["metadata"]["resourceVersion"] = self._next_rv()
        if propagation == "Orphan":
            stored = self._objects.pop(key)
            self._emit("DELETED", stored.rtype, copy.deepcopy(out), None)
            return out
        return self._remove(key, out)

    def _terminate_namespace(self, key: Key, live: Obj) -> Obj:
        """A deleted namespace terminates (its finalizer `kubernetes` holds it) until the
        namespace controller (`finish_namespace`, the test's) has emptied it."""
        if live["metadata"].get("deletionTimestamp"):
            return copy.deepcopy(live)
        out = copy.deepcopy(live)
        out["metadata"]["deletionTimestamp"] = now_rfc3339()
        out["spec"] = {"finalizers": ["kubernetes"]}
        out["status"] = {"phase": "Terminating"}
        out["metadata"]["resourceVersion"] = self._next_rv()
        self._objects[key].obj = out
        self._emit("MODIFIED", self._objects[key].rtype, copy.deepcopy(out), copy.deepcopy(live))
        return copy.deepcopy(out)

    def finish_namespace(self, namespace: str) -> bool:
        """One pass of the namespace controller over a terminating namespace: delete what is
        in it (objects with finalizers wait for them), and the namespace itself once empty.
        True when it is gone."""
        with self._lock:
            key: Key = ("", "namespaces", "", namespace)
            if key not in self._objects:
                return True
            assert self._objects[key].obj["metadata"].get("deletionTimestamp"), namespace
            inside = [(k, s.rtype) for k, s in self._objects.items() if k[2] == namespace]
            for (_, _, ns, obj_name), rtype in inside:
                if rtype.namespaced and self._key(rtype, ns, obj_name) in self._objects:
                    self._delete(rtype, ns, obj_name, "Background")
            if any(k[2] == namespace for k in self._objects if k != key):
                return False
            self._remove(key, self._objects[key].obj)
            return True

    def _select(
        self, rtype: ResourceType, namespace: str | None, name: str | None, selector: str
    ) -> list[Obj]:
        out = []
        for (group, plural, ns, obj_name), stored in sorted(self._objects.items()):
            if (group, plural) != (rtype.group, rtype.plural):
                continue
            if namespace and rtype.namespaced and ns != namespace:
                continue
            if name is not None and obj_name != name:
                continue
            if selector and not selector_matches(
                selector, stored.obj["metadata"].get("labels") or {}
            ):
                continue
            out.append(stored.obj)
        return out

    def _apply(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        applied: Obj,
        manager: str,
        subresource: str | None,
        *,
        force: bool = False,
    ) -> Obj:
        """Server-side apply (support/ssa.py): 409 on a conflict unless `force`."""
        if not isinstance(applied, dict):
            raise ApiError(400, "the apply patch must be an object")
        if (applied.get("apiVersion"), applied.get("kind")) != (rtype.api_version, rtype.kind):
            raise ApiError(400, "apiVersion and kind of the applied object must match the request")
        meta = applied.get("metadata") or {}
        if meta.get("name") != name:
            raise ApiError(400, "the name of the applied object does not match the request")
        if rtype.namespaced and meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "the namespace of the applied object does not match the request")
        if meta.get("managedFields") is not None:
            raise ApiError(400, "metadata.managedFields must be nil")
        # Each of the two field managers resets what the other owns (the strategies'
        # GetResetFields): the main resource ignores status, /status everything else.
        if subresource == "status":
            ids = {k: meta[k] for k in ("name", "namespace") if k in meta}
            applied = {**{k: applied[k] for k in ("apiVersion", "kind", "status") if k in applied},
                       "metadata": ids}  # fmt: skip
        elif rtype.status_subresource:
            applied = {k: v for k, v in applied.items() if k != "status"}
        stored = self._objects.get(self._key(rtype, namespace, name))
        if stored is None and subresource:
            raise ApiError(404, f'{rtype.plural} "{name}" not found')
        live = stored.obj if stored is not None else None
        entries = ssa.decode((live or {}).get("metadata", {}).get("managedFields") or [])
        if entries is None:
            raise ApiError(500, "failed to decode managed fields")
        try:
            merged, entries = ssa.apply(
                live, applied, entries, manager=manager, api_version=rtype.api_version,
                subresource=subresource or "", force=force, t=self._field_type(rtype),
                now=now_rfc3339(),
            )  # fmt: skip
        except ssa.ApplyConflict as exc:
            raise ApiError(409, exc.message(), details={"causes": exc.causes()}) from exc
        except fs.FieldSetError as exc:
            what = f"{namespace}/{name}; {rtype.api_version}, Kind={rtype.kind}"
            raise ApiError(500, f"failed to create typed patch object ({what}): {exc}") from exc
        if live is None:
            return self._create(
                rtype, namespace, merged, keep_status=False, manager=manager, managed=entries
            )
        rv = meta.get("resourceVersion")
        return self._update(
            rtype, live, merged, subresource, manager, precondition_rv=rv, managed=entries
        )

    # --- what the server stores (support/builtin_defaults.py, support/ssa.py) ---------------
    def _field_type(self, rtype: ResourceType) -> ft.FieldType:
        """The kind's schema for server-side apply and strategic merge."""
        if not rtype.custom:
            return ft.builtin(rtype.api_version, rtype.kind)
        crd_name = f"{rtype.plural}.{rtype.group}"
        stored = self._objects.get(
            ("apiextensions.k8s.io", "customresourcedefinitions", "", crd_name)
        )
        if stored is None:
            return ft.LOOSE
        meta = stored.obj["metadata"]
        key = (f"{meta['uid']}/{meta['resourceVersion']}", rtype.version)
        if key not in self._crd_types:
            self._crd_types[key] = ft.custom_resource(stored.obj, rtype.version)
        return self._crd_types[key]

    def _decode(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> Obj:
        """A built-in object as the server decodes, defaults and stores it (400 for a bad
        quantity, as a body that does not decode into the kind's Go type)."""
        try:
            return builtin_defaults.decode(
                rtype.api_version, rtype.kind, obj, old=old, cluster_ip=self._cluster_ip
            )
        except quantity_canon.QuantityError as exc:
            raise ApiError(
                400,
                f'{rtype.kind} in version "{rtype.version}" cannot be handled as a '
                f"{rtype.kind}: {exc}",
            ) from exc

    def _cluster_ip(self, namespace: str, name: str) -> str:
        """The Service's ClusterIP: the same for every attempt of one write (a write asks its
        webhooks, then is served again) and for a Service created again."""
        n = len(self._service_ips) + 1
        return self._service_ips.setdefault((namespace, name), f"10.96.{n // 254}.{n % 254 + 1}")

    def _track_update(
        self,
        rtype: ResourceType,
        live: Obj | None,
        new: Obj,
        out: Obj,
        before: list[ssa.Entry],
        manager: str,
        subresource: str | None,
    ) -> list[ssa.Entry]:
        """managedFields after an Update (`live` None: a create): the written object's own
        managedFields when it sends valid ones for the main resource (`[]` clears them), else
        the live object's. Objects the schema cannot type keep the old entries, and the write
        goes on (fieldmanager.go UpdateNoErrors)."""
        sent = (new.get("metadata") or {}).get("managedFields")
        entries = before
        if live is not None and not subresource and ssa.is_reset(sent):
            entries = []
        elif live is not None and not subresource and sent is not None:
            entries = ssa.decode(sent) or before
        try:
            return ssa.update(
                live, out, entries, manager=manager, api_version=rtype.api_version,
                subresource=subresource or "", t=self._field_type(rtype), now=now_rfc3339(),
            )  # fmt: skip
        except fs.FieldSetError:
            return before

    # --- HTTP ------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        """Log the request, then serve it. A request other than a watch is served, and its log
        entry completed with the response code, in one hold of the lock: whoever sees what it
        did (through the object helpers or another request) also sees it logged as done. A
        write that needs a webhook's answer has no effect yet: the answer is asked outside the
        lock, and the request served again (its effect and code then in one hold)."""
        raw = await request.read()
        for held in list(self._holds):
            if held.method == request.method and held.path in request.path:
                held.arrived.set()
                while not held.release.is_set():
                    await asyncio.sleep(0.02)
        if len(raw) > MAX_REQUEST_BODY_BYTES:  # the apiserver's MaxRequestBodyBytes
            with self._lock:
                self.requests.append(Request(request.method, request.path, {}, None, None, 413))
            limit = f"Request entity too large: limit is {MAX_REQUEST_BODY_BYTES}"
            return ApiError(413, limit, "RequestEntityTooLarge").response()
        ctype = request.headers.get("Content-Type")
        query = {k: v for k, v in request.query.items()}
        body: Any = None
        if raw:
            try:
                body = yaml.safe_load(raw) if ctype and "yaml" in ctype else json.loads(raw)
            except (ValueError, yaml.YAMLError):
                body = raw.decode("utf-8", "replace")
        logged = Request(request.method, request.path, query, ctype, body)
        served: web.StreamResponse | _WatchTarget | None = None
        for round_ in range(_MAX_WEBHOOK_ROUNDS):
            pending: _AskWebhook | None = None
            with self._lock:
                try:
                    if round_ == 0:
                        self.requests.append(logged)
                        self._inject_failure(request.method, request.path)
                    self._user = self._authenticated(request)
                    logged.user = self._user.name
                    self._authorize(self._user, request, query)
                    served = self._respond_admitted(request, query, ctype, body, logged)
                except _AskWebhook as ask:
                    pending = ask
                except ApiError as exc:
                    served = exc.response()
                finally:
                    self._user = rbac.ADMIN
                if isinstance(served, web.StreamResponse):
                    logged.code = served.status
                    return served
            if pending is None:
                break  # a watch, streamed below
            # Ask outside the lock (the webhook may call this server), then serve it again.
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(None, call_webhook, pending.webhook, pending.review)
            with self._lock:
                self._answers[pending.key] = answer
        if not isinstance(served, _WatchTarget):
            with self._lock:
                logged.code = 500
            return ApiError(500, "the object kept changing while webhooks were asked").response()
        try:
            response = await self._watch(request, served.rtype, served.namespace, query)
        except ApiError as exc:
            response = exc.response()
        logged.code = response.status  # a watch is logged as done when its stream ends
        return response

    def _respond_admitted(
        self,
        request: web.Request,
        query: dict[str, str],
        ctype: str | None,
        body: Any,
        logged: Request,
    ) -> web.StreamResponse | _WatchTarget:
        """`_respond` (call with the lock held) for one request: with `dryRun=All` it writes
        nothing; the webhooks' warnings become Warning headers, on refusals too."""
        dry_run = query.get("dryRun")
        if dry_run not in (None, "All"):
            raise ApiError(400, f'dryRun: Unsupported value: "{dry_run}": supported values: "All"')
        self._dry_run, self._warnings = dry_run == "All", []
        try:
            try:
                served = self._respond(request, query, ctype, body)
            except ApiError as exc:
                served = exc.response()
                causes = (exc.details or {}).get("causes") or [{}]
                logged.cause = str(causes[0].get("reason", ""))
            if isinstance(served, web.StreamResponse):
                for warning in self._warnings:
                    served.headers.add("Warning", f'299 - "{warning}"')
            logged.warnings = list(self._warnings)
            return served
        finally:
            self._dry_run, self._warnings = False, []

    def _inject_failure(self, method: str, path: str) -> None:
        for failure in self._failures:
            if (
                failure.times > 0
                and (failure.method in (None, method))
                and (failure.path is None or failure.path in path)
            ):
                failure.times -= 1
                raise ApiError(failure.code, failure.message, failure.reason)
        self._failures = [f for f in self._failures if f.times > 0]

    def _respond(
        self, request: web.Request, query: dict[str, str], ctype: str | None, body: Any
    ) -> web.StreamResponse | _WatchTarget:
        """The response to a request (call with the lock held), or what a watch streams."""
        parts = [p for p in request.path.split("/") if p]
        if parts == ["version"]:
            return web.json_response(
                {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake", "platform": "linux"}
            )
        if parts == ["api"]:
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if parts == ["apis"]:
            return web.json_response(self._group_list())
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "the server could not find the requested resource")
        if not rest:
            return web.json_response(self._resource_list(group, version))
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError(404, "the server could not find the requested resource")
        rtype = self._types.get((group, version, rest[0]))
        if rtype is None or (namespace is not None and not rtype.namespaced):
            raise ApiError(404, "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and not (sub == "status" and rtype.status_subresource):
            raise ApiError(404, "the server could not find the requested resource")
        if rtype.namespaced and name is not None and namespace is None:
            raise ApiError(404, "the server could not find the requested resource")
        method = request.method
        manager = (
            query.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
        )
        if method == "GET" and name is None and query.get("watch") in ("true", "1"):
            return _WatchTarget(rtype, namespace)
        if method == "GET" and rtype.custom and wants_table(request.headers.get("Accept", "")):
            return web.json_response(self._table(rtype, namespace, name, query))
        if method == "GET":
            if name is None:
                return web.json_response(self._list_response(rtype, namespace, query))
            return web.json_response(self._require(rtype, namespace or "", name))
        if method == "POST" and name is None:
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be an object")
            ns = namespace or "" if rtype.namespaced else ""
            created = self._create(rtype, ns, body, keep_status=False, manager=manager)
            return web.json_response(created, status=201)
        if method == "PUT" and name is not None:
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be an object")
            live = self._require(rtype, namespace or "", name)
            rv = (body.get("metadata") or {}).get("resourceVersion")
            return web.json_response(
                self._update(rtype, live, body, sub, manager, precondition_rv=rv)
            )
        if method == "PATCH" and name is not None:
            existed = self._key(rtype, namespace, name) in self._objects
            patched = self._patch(rtype, namespace or "", name, sub, query, ctype, body, manager)
            return web.json_response(patched, status=200 if existed else 201)
        if method == "DELETE" and self._dry_run:
            if name is not None:
                return web.json_response(self._require(rtype, namespace or "", name))
            matching = self._select(rtype, namespace, None, query.get("labelSelector", ""))
            return web.json_response(self._as_list(rtype, matching))
        if method == "DELETE" and name is not None:
            options = body if isinstance(body, dict) else {}
            policy = options.get("propagationPolicy") or query.get("propagationPolicy", "")
            return web.json_response(self._delete(rtype, namespace or "", name, policy))
        if method == "DELETE" and name is None:
            matching = self._select(rtype, namespace, None, query.get("labelSelector", ""))
            keys = [(o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in matching]
            gone = [
                self._delete(rtype, ns, obj_name, "")
                for ns, obj_name in keys
                if self._key(rtype, ns, obj_name) in self._objects
            ]
            return web.json_response(self._as_list(rtype, gone))
        raise ApiError(405, f"{method} is not supported on {request.path}")

    def _patch(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        sub: str | None,
        query: dict[str, str],
        ctype: str | None,
        body: Any,
        manager: str,
    ) -> Obj:
        media = (ctype or "").split(";")[0].strip()
        accepted = _PATCH_TYPES_CUSTOM if rtype.custom else _PATCH_TYPES_BUILTIN
        if media not in accepted:  # handlers/patch.go: strategic merge is not for custom kinds
            raise ApiError(
                415,
                "the body of the request was in an unknown format - accepted media types "
                f"include: {', '.join(accepted)}",
            )
        if media == "application/apply-patch+yaml":
            if not query.get("fieldManager"):
                raise _invalid_patch_options(
                    "fieldManager: Required value: is required for apply patch"
                )
            force = query.get("force") == "true"
            return self._apply(
                rtype, namespace, name, body, query["fieldManager"], sub, force=force
            )
        if "force" in query:
            raise _invalid_patch_options(
                "force: Forbidden: may not be specified for non-apply patch"
            )
        live = self._require(rtype, namespace, name)
        if media in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(body, dict):
                raise ApiError(400, "a merge patch must be an object")
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if media == "application/merge-patch+json":
                new = merge_patch(live, body)
            else:
                try:
                    new = strategic_merge.apply_patch(live, body, self._field_type(rtype))
                except strategic_merge.PatchError as exc:
                    raise ApiError(exc.code, exc.message) from exc
            return self._update(rtype, live, new, sub, manager, precondition_rv=rv)
        if not isinstance(body, list):
            raise ApiError(400, "a JSON patch must be a list of operations")
        return self._update(rtype, live, json_patch(live, body), sub, manager)

    def _group_list(self) -> Obj:
        groups: dict[str, list[str]] = {}
        for rtype in self._types.values():
            if rtype.group:
                versions = groups.setdefault(rtype.group, [])
                if rtype.version not in versions:
                    versions.append(rtype.version)
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": group,
                    "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
                    "preferredVersion": {
                        "groupVersion": f"{group}/{versions[0]}",
                        "version": versions[0],
                    },
                }
                for group, versions in sorted(groups.items())
            ],
        }

    def _resource_list(self, group: str, version: str) -> Obj:
        types = [t for t in self._types.values() if (t.group, t.version) == (group, version)]
        if not types:
            raise ApiError(404, "the server could not find the requested resource")
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": [entry for t in types for entry in t.discovery()],
        }

    def _table(
        self, rtype: ResourceType, namespace: str | None, name: str | None, query: dict[str, str]
    ) -> Obj:
        """`kubectl get`'s answer: the custom resources as a Table of the CRD's printer
        columns (support/printer_table.py)."""
        crd_name = f"{rtype.plural}.{rtype.group}"
        crd = self._objects.get(("apiextensions.k8s.io", "customresourcedefinitions", "", crd_name))
        columns = printer_columns(crd.obj, rtype.version) if crd is not None else []
        if name is not None:
            items = [self._require(rtype, namespace or "", name)]
            listed = {"metadata": {"resourceVersion": items[0]["metadata"]["resourceVersion"]}}
        else:
            listed = self._list_response(rtype, namespace, query)
            items = listed["items"]
        out = table(columns, items, include_object=query.get("includeObject", "Metadata"))
        out["metadata"] = listed["metadata"]
        return out

    def _as_list(self, rtype: ResourceType, items: list[Obj]) -> Obj:
        if not rtype.custom:  # the server omits type meta on items of built-in kinds
            items = [{k: v for k, v in o.items() if k not in ("apiVersion", "kind")} for o in items]
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version,
            "metadata": {"resourceVersion": str(self._last_rv)},
            "items": copy.deepcopy(items),
        }

    def _field_name(self, query: dict[str, str]) -> tuple[str | None, str | None]:
        name = namespace = None
        for part in _split_selector(query.get("fieldSelector", "")):
            key, _, value = part.partition("=")
            if key == "metadata.name":
                name = value
            elif key == "metadata.namespace":
                namespace = value
            else:
                raise ApiError(400, f"field label not supported: {key}")
        return name, namespace

    def _list_response(
        self, rtype: ResourceType, namespace: str | None, query: dict[str, str]
    ) -> Obj:
        name, field_ns = self._field_name(query)
        selector = query.get("labelSelector", "")
        limit, token = int(query.get("limit") or 0), query.get("continue", "")
        if limit <= 0 and not token:
            return self._as_list(rtype, self._select(rtype, namespace or field_ns, name, selector))
        if token and query.get("resourceVersion"):
            raise ApiError(400, "specifying resource version is not allowed when using continue")

        def keep(obj: Obj) -> bool:
            meta = obj["metadata"]
            return (name is None or meta["name"] == name) and selector_matches(
                selector, meta.get("labels") or {}
            )

        current = [
            (f"{ns}/{obj_name}" if rtype.namespaced else obj_name, copy.deepcopy(stored.obj))
            for (group, plural, ns, obj_name), stored in self._objects.items()
            if (group, plural) == (rtype.group, rtype.plural)
        ]
        try:
            page = self._pages.page(
                f"{rtype.group}/{rtype.plural}",
                current,
                namespace=(namespace or field_ns or "") if rtype.namespaced else "",
                rv_now=self._last_rv,
                compacted_rv=self._history.compacted_rv,
                limit=limit,
                token=token,
                keep=keep,
                filtered=bool(selector or query.get("fieldSelector")),
            )
        except watch_cache.Expired as exc:
            raise ApiError(
                410, exc.message, "Expired", list_meta={"continue": exc.continue_token}
            ) from exc
        except watch_cache.BadRequest as exc:
            raise ApiError(400, str(exc)) from exc
        out = self._as_list(rtype, page.items)
        out["metadata"] = {"resourceVersion": str(page.resource_version)}
        if page.continue_token:
            out["metadata"]["continue"] = page.continue_token
        if page.remaining_item_count is not None:
            out["metadata"]["remainingItemCount"] = page.remaining_item_count
        return out

    async def _watch(
        self,
        request: web.Request,
        rtype: ResourceType,
        namespace: str | None,
        query: dict[str, str],
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        name, field_ns = self._field_name(query)
        selector = query.get("labelSelector", "")
        selector_matches(selector, {})  # 400 on a bad selector before the stream starts
        watch = _Watch(rtype, namespace or field_ns, name, selector, asyncio.Queue(), loop)
        since = query.get("resourceVersion", "")
        initial = query.get("sendInitialEvents") == "true"
        timeout = float(query.get("timeoutSeconds") or 1800)
        expired: ApiError | None = None  # the history since `since` is gone
        with self._lock:
            if since in ("", "0") or initial:
                snapshot = self._select(rtype, watch.namespace, name, selector)
                for obj in snapshot:
                    rv = int(obj["metadata"]["resourceVersion"])
                    watch.queue.put_nowait(_Event(rv, "ADDED", rtype, copy.deepcopy(obj), None))
                if initial:
                    bookmark = {
                        "apiVersion": rtype.api_version,
                        "kind": rtype.kind,
                        "metadata": {
                            "resourceVersion": str(self._last_rv),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    }
                    watch.queue.put_nowait(_Event(self._last_rv, "BOOKMARK", rtype, bookmark, None))
            else:
                try:
                    missed = self._history.since(int(since))
                except watch_cache.Expired as exc:
                    expired = ApiError(410, exc.message, "Expired")
                else:
                    for event in missed:
                        if event.rtype == rtype:
                            watch.queue.put_nowait(event)
            if not expired:
                self._watches.append(watch)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if expired:  # as the cacher does: an ERROR event, then the stream ends
            line = json.dumps({"type": "ERROR", "object": expired.status()}) + "\n"
            await response.write(line.encode())
            await response.write_eof()
            return response
        deadline = loop.time() + timeout
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(watch.queue.get(), left)
                except TimeoutError:
                    break
                if event is None:
                    break
                line = self._watch_line(watch, event)
                if line is not None:
                    await response.write(line)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        finally:
            with self._lock:
                self._watches.remove(watch)
        return response

    def _watch_line(self, watch: _Watch, event: _Event) -> bytes | None:
        def visible(obj: Obj | None) -> bool:
            if obj is None:
                return False
            meta = obj.get("metadata", {})
            if (
                watch.rtype.namespaced
                and watch.namespace
                and meta.get("namespace") != watch.namespace
            ):
                return False
            if watch.name is not None and meta.get("name") != watch.name:
                return False
            return selector_matches(watch.selector, meta.get("labels") or {})

        kind = event.type
        if kind == "MODIFIED":
            now, before = visible(event.obj), visible(event.old)
            if not now and not before:
                return None
            kind = "MODIFIED" if now and before else "ADDED" if now else "DELETED"
        elif kind != "BOOKMARK" and not visible(event.obj):
            return None
        return (json.dumps({"type": kind, "object": event.obj}) + "\n").encode()


def _admit_secret(secret: Obj) -> Obj:
    """As the real server: `stringData` is write-only, merged into `data` (base64)."""
    string_data = secret.pop("stringData", None) or {}
    if string_data:
        data = secret.setdefault("data", {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
    return secret


def _admit_crd(crd: Obj) -> Obj:
    """The API server's CRD validation (the parts support/crd_rules.py restates)."""
    errors = crd_rules.crd_errors(crd)
    if errors:
        raise AdmissionError(errors)
    return crd


def load_crd(path: Path) -> Obj:
    crd: Obj = yaml.safe_load(path.read_text())
    return crd
