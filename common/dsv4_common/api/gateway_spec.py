"""`spec.gateway`: the deployment behind the Gateway API Inference Extension. The operator
renders an InferencePool (inference.networking.k8s.io/v1) selecting the decode groups' serving
pods, with the endpoint picker the user runs and names here, an HTTPRoute from the user's
Gateways to that pool, and a NetworkPolicy admitting the gateway's namespaces to those pods.
Pure; errors recorded on the caller's `FieldReader`, each naming its field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, cast

from dsv4_common.api.fields import FieldReader

FailureMode = Literal["FailOpen", "FailClose"]
FAILURE_MODES: Final[tuple[FailureMode, ...]] = ("FailOpen", "FailClose")
DEFAULT_PICKER_PORT: Final = 9002  # the endpoint picker's ext-proc port (GIE's default)
MAX_PARENTS: Final = 32
_DNS_SUBDOMAIN: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KIND: Final = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
_SECTION: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PATH: Final = re.compile(r"^/[^\s;]*$")


@dataclass(frozen=True, slots=True)
class EndpointPicker:
    """The endpoint picker (EPP) the pool names: a Service in the CR's namespace by default."""

    name: str
    port: int = DEFAULT_PICKER_PORT
    kind: str = "Service"
    group: str = ""
    failure_mode: FailureMode = "FailClose"


@dataclass(frozen=True, slots=True)
class ParentRef:
    """A Gateway the HTTPRoute attaches to."""

    name: str
    namespace: str | None = None  # None: the CR's
    section_name: str | None = None


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    endpoint_picker: EndpointPicker
    parent_refs: tuple[ParentRef, ...] = ()  # empty: no HTTPRoute
    path_prefix: str = "/"
    # Namespaces whose pods (the gateway's proxies, the endpoint picker) reach the decode pods'
    # API and status ports.
    allow_from_namespaces: tuple[str, ...] = ()


def parse_gateway(r: FieldReader, raw: object) -> GatewaySpec | None:
    if raw is None:
        return None
    path = "spec.gateway"
    m = r.obj(raw, path)
    r.keys(m, path, {"endpointPicker", "parentRefs", "pathPrefix", "allowFromNamespaces"})
    picker = _picker(r, m.get("endpointPicker"), f"{path}.endpointPicker")
    parents = _parents(r, m.get("parentRefs"), f"{path}.parentRefs")
    prefix = r.string(
        m,
        "pathPrefix",
        path,
        max_length=1024,
        pattern=_PATH,
        pattern_hint="must be an absolute path such as /v1",
    )
    allow = _namespaces(r, m.get("allowFromNamespaces"), f"{path}.allowFromNamespaces")
    if picker is None:
        return None
    return GatewaySpec(picker, parents, prefix or "/", allow)


def _picker(r: FieldReader, raw: object, path: str) -> EndpointPicker | None:
    m = r.obj(raw, path, required=True)
    r.keys(m, path, {"name", "port", "kind", "group", "failureMode"})
    if m.get("name") is None and isinstance(raw, Mapping):
        r.fail(f"{path}.name", "required")
    name = r.string(m, "name", path, max_length=253, pattern=_DNS_SUBDOMAIN)
    port = r.integer(m, "port", path, DEFAULT_PICKER_PORT, 1, 65535)
    kind = r.string(m, "kind", path, max_length=63, pattern=_KIND) or "Service"
    group = m.get("group")
    if group is not None and not (
        isinstance(group, str) and (group == "" or _DNS_SUBDOMAIN.match(group))
    ):
        r.fail(f"{path}.group", f"must be an API group (a DNS subdomain, or empty), got {group!r}")
        group = None
    mode = r.string(m, "failureMode", path, enum=FAILURE_MODES) or "FailClose"
    if name is None:
        return None
    return EndpointPicker(
        name=name,
        port=port or DEFAULT_PICKER_PORT,
        kind=kind,
        group=group or "",
        failure_mode=cast(FailureMode, mode),
    )


def _parents(r: FieldReader, raw: object, path: str) -> tuple[ParentRef, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_PARENTS:
        r.fail(path, f"must be a list of at most {MAX_PARENTS} Gateways, got {raw!r}")
        return ()
    out = []
    for i, item in enumerate(raw):
        where = f"{path}[{i}]"
        m = r.obj(item, where, required=True)
        r.keys(m, where, {"name", "namespace", "sectionName"})
        if m.get("name") is None:
            r.fail(f"{where}.name", "required")
        name = r.string(m, "name", where, max_length=253, pattern=_DNS_SUBDOMAIN)
        namespace = r.string(m, "namespace", where, max_length=63, pattern=_DNS_LABEL)
        section = r.string(m, "sectionName", where, max_length=253, pattern=_SECTION)
        if name is not None:
            out.append(ParentRef(name, namespace, section))
    return tuple(out)


def _namespaces(r: FieldReader, raw: object, path: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > 16:
        r.fail(path, f"must be a list of at most 16 namespaces, got {raw!r}")
        return ()
    out = []
    for i, name in enumerate(raw):
        if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.match(name):
            r.fail(f"{path}[{i}]", f"must be a namespace name (a DNS label), got {name!r}")
        elif name not in out:
            out.append(name)
    return tuple(out)
