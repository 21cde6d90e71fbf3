"""Authorization as the real API server does it with `--authorization-mode=RBAC`, for the fake
API server (pure: the fake hands in the request and the RBAC objects it stores). Each part
restates an upstream rule:

- `request_attributes`: k8s.io/apiserver pkg/endpoints/request/requestinfo.go,
  RequestInfoFactory.NewRequestInfo (verb from the method: a GET without a name is `list`, or
  `watch` with ?watch=true; a DELETE without a name is `deletecollection`; a list or watch whose
  fieldSelector pins metadata.name is authorized for that name; `/namespaces/NS` is the
  namespace's own path; fewer than 3 path segments is a non-resource request).
- `rule_allows`: kubernetes plugin/pkg/auth/authorizer/rbac/rbac.go, RuleAllows, and
  pkg/apis/rbac/v1/evaluation_helpers.go (VerbMatches, APIGroupMatches, ResourceMatches with
  `res/sub` and `*/sub`, ResourceNameMatches, NonResourceURLMatches with a trailing `*`).
- `authorize`: pkg/registry/rbac/validation/rule.go, VisitRulesFor: ClusterRoleBindings grant
  their ClusterRole everywhere; a RoleBinding grants its Role or ClusterRole only in its own
  namespace, so cluster-scoped requests (namespace "") are granted by ClusterRoleBindings only;
  a binding whose role is missing grants nothing and says so in the reason
  (`RBAC: clusterrole.rbac.authorization.k8s.io "x" not found`). Subjects: appliesToUser
  (ServiceAccount as `system:serviceaccount:NS:NAME`, User by name, Group by membership).
  Members of system:masters are allowed everything (the privileged-group authorizer).
- `BOOTSTRAP_CLUSTER_ROLES`: plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go, the
  discovery roles every authenticated user is bound to (system:discovery,
  system:public-info-viewer, system:basic-user).
- `forbidden_message`: k8s.io/apiserver pkg/endpoints/handlers/responsewriters/errors.go,
  ForbiddenStatusError + forbiddenMessage, inside apimachinery's NewForbidden wording.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

Obj = Mapping[str, Any]

RBAC_GROUP: Final = "rbac.authorization.k8s.io"
MASTERS: Final = "system:masters"
AUTHENTICATED: Final = "system:authenticated"


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = (AUTHENTICATED,)


ADMIN: Final = User("system:admin", (MASTERS, AUTHENTICATED))


def service_account_user(namespace: str, name: str) -> User:
    """The user a ServiceAccount's token authenticates as (serviceaccount.MakeUsername and
    MakeGroupNames)."""
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


# ---------------------------------------------------------------------------------------------
# Request attributes


@dataclass(frozen=True)
class Attributes:
    verb: str
    path: str
    resource_request: bool
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""


_SPECIAL_VERBS: Final = ("proxy", "watch")
_NAMESPACE_SUBRESOURCES: Final = ("status", "finalize")
_VERBS_BY_METHOD: Final = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}
_PATH_SEGMENT_NAME = re.compile(r"^[^/%]+$")


def _exact_name(field_selector: str) -> str:
    """The name a fieldSelector requires exactly (`metadata.name=x` or `==x`), else ""."""
    for part in field_selector.split(","):
        match = re.fullmatch(r"\s*metadata\.name\s*(?:==|=)\s*(.*?)\s*", part)
        if match and match[1] not in (".", "..") and _PATH_SEGMENT_NAME.match(match[1]):
            return match[1]
    return ""


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """What the authorizer is asked about one HTTP request (requestinfo.go)."""
    parts = [p for p in path.strip("/").split("/") if p]
    non_resource = Attributes(method.lower(), path, False)
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return non_resource
    prefix, parts = parts[0], parts[1:]
    group = ""
    if prefix == "apis":
        if len(parts) < 3:
            return non_resource
        group, parts = parts[0], parts[1:]
    version, parts = parts[0], parts[1:]
    if parts[0] in _SPECIAL_VERBS and len(parts) >= 2:
        verb, parts = parts[0], parts[1:]
    else:
        verb = _VERBS_BY_METHOD.get(method.upper(), "")
    namespace = ""
    if parts[0] == "namespaces" and len(parts) > 1:
        namespace = parts[1]
        if len(parts) > 2 and parts[2] not in _NAMESPACE_SUBRESOURCES:
            parts = parts[2:]
    resource = parts[0]
    name = parts[1] if len(parts) >= 2 else ""
    subresource = parts[2] if len(parts) >= 3 and verb != "proxy" else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch", "").lower() not in ("", "false", "0") else "list"
        name = _exact_name(query.get("fieldSelector", ""))
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb, path, True, group, version, namespace, resource, subresource, name)


# ---------------------------------------------------------------------------------------------
# Rules


def _verb_matches(rule: Obj, verb: str) -> bool:
    return any(v in ("*", verb) for v in rule.get("verbs") or ())


def _group_matches(rule: Obj, group: str) -> bool:
    return any(g in ("*", group) for g in rule.get("apiGroups") or ())


def _resource_matches(rule: Obj, combined: str, subresource: str) -> bool:
    for resource in rule.get("resources") or ():
        if resource in ("*", combined):
            return True
        if subresource and resource == f"*/{subresource}":
            return True
    return False


def _name_matches(rule: Obj, name: str) -> bool:
    names = rule.get("resourceNames") or ()
    return not names or name in names


def _url_matches(rule: Obj, path: str) -> bool:
    for url in rule.get("nonResourceURLs") or ():
        if url in ("*", path):
            return True
        if url.endswith("*") and path.startswith(url.rstrip("*")):
            return True
    return False


def rule_allows(rule: Obj, attrs: Attributes) -> bool:
    """One PolicyRule grants the request (rbac.go RuleAllows)."""
    if not attrs.resource_request:
        return _verb_matches(rule, attrs.verb) and _url_matches(rule, attrs.path)
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    return (
        _verb_matches(rule, attrs.verb)
        and _group_matches(rule, attrs.api_group)
        and _resource_matches(rule, combined, attrs.subresource)
        and _name_matches(rule, attrs.name)
    )


# ---------------------------------------------------------------------------------------------
# Roles and bindings

_DISCOVERY_URLS: Final = (
    "/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*",
    "/readyz", "/version", "/version/",
)  # fmt: skip

BOOTSTRAP_CLUSTER_ROLES: Final[Mapping[str, Sequence[Obj]]] = {
    "system:discovery": [{"nonResourceURLs": list(_DISCOVERY_URLS), "verbs": ["get"]}],
    "system:public-info-viewer": [
        {
            "nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"],
            "verbs": ["get"],
        }
    ],
    "system:basic-user": [
        {
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
            "verbs": ["create"],
        }
    ],
}
_BOOTSTRAP_BINDINGS: Final = tuple(
    {
        "metadata": {"name": role},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": AUTHENTICATED}],
    }
    for role in BOOTSTRAP_CLUSTER_ROLES
)


@dataclass(frozen=True)
class Policy:
    """The RBAC objects of a cluster, as stored (plus the bootstrap discovery roles)."""

    roles: Mapping[tuple[str, str], Sequence[Obj]]  # (namespace, name) -> rules
    cluster_roles: Mapping[str, Sequence[Obj]]  # name -> rules
    role_bindings: Sequence[Obj]
    cluster_role_bindings: Sequence[Obj]

    @classmethod
    def from_objects(cls, objects: Iterable[Obj]) -> Policy:
        roles: dict[tuple[str, str], Sequence[Obj]] = {}
        cluster_roles: dict[str, Sequence[Obj]] = dict(BOOTSTRAP_CLUSTER_ROLES)
        role_bindings: list[Obj] = []
        cluster_role_bindings: list[Obj] = list(_BOOTSTRAP_BINDINGS)
        for obj in objects:
            meta, kind = obj.get("metadata") or {}, obj.get("kind")
            if kind == "Role":
                roles[(meta.get("namespace", ""), meta["name"])] = obj.get("rules") or []
            elif kind == "ClusterRole":
                cluster_roles[meta["name"]] = obj.get("rules") or []
            elif kind == "RoleBinding":
                role_bindings.append(obj)
            elif kind == "ClusterRoleBinding":
                cluster_role_bindings.append(obj)
        return cls(roles, cluster_roles, role_bindings, cluster_role_bindings)


def _applies_to(subject: Obj, user: User, binding_namespace: str) -> bool:
    """rule.go appliesToUser: a ServiceAccount subject names its namespace (a RoleBinding's
    subject may leave it out: the binding's namespace)."""
    kind, name = subject.get("kind"), subject.get("name", "")
    if kind == "User":
        return bool(user.name == name)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return bool(namespace) and user.name == f"system:serviceaccount:{namespace}:{name}"
    return False


def _role_rules(policy: Policy, binding: Obj, namespace: str) -> tuple[Sequence[Obj], str]:
    """The rules a binding's roleRef names, or an error when the role does not exist."""
    ref = binding.get("roleRef") or {}
    name = ref.get("name", "")
    if ref.get("kind") == "ClusterRole":
        rules = policy.cluster_roles.get(name)
        missing = f'clusterrole.{RBAC_GROUP} "{name}" not found'
    else:
        rules = policy.roles.get((namespace, name))
        missing = f'role.{RBAC_GROUP} "{name}" not found'
    return (rules, "") if rules is not None else ((), missing)


def authorize(policy: Policy, user: User, attrs: Attributes) -> tuple[bool, str]:
    """(allowed, reason): the reason names bindings whose role is missing, as RBAC's does."""
    if MASTERS in user.groups:
        return True, ""
    errors: list[str] = []
    bindings = [(b, "") for b in policy.cluster_role_bindings]
    if attrs.namespace:
        bindings += [
            (b, attrs.namespace)
            for b in policy.role_bindings
            if (b.get("metadata") or {}).get("namespace") == attrs.namespace
        ]
    for binding, namespace in bindings:
        if not any(_applies_to(s, user, namespace) for s in binding.get("subjects") or ()):
            continue
        rules, error = _role_rules(policy, binding, namespace)
        if error:
            errors.append(error)
        if any(rule_allows(rule, attrs) for rule in rules):
            return True, ""
    reason = f"RBAC: {errors[0] if len(errors) == 1 else '[' + ', '.join(errors) + ']'}"
    return False, reason if errors else ""


def forbidden_message(user: User, attrs: Attributes, reason: str = "") -> str:
    """The message of the 403 Status the API server answers a denied request with."""
    if not attrs.resource_request:
        detail = f'User "{user.name}" cannot {attrs.verb} path "{attrs.path}"'
        return f"forbidden: {detail}: {reason}" if reason else f"forbidden: {detail}"
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    detail = (
        f'User "{user.name}" cannot {attrs.verb} resource "{resource}" in API group '
        f'"{attrs.api_group}" {where}'
    )
    if reason:
        detail = f"{detail}: {reason}"
    return f"{qualified(attrs.api_group, attrs.resource, attrs.name)} is forbidden: {detail}"


def qualified(group: str, resource: str, name: str) -> str:
    """apimachinery NewForbidden's subject: `pods "x"`, `statefulsets.apps "x"`, `pods`."""
    what = f"{resource}.{group}" if group else resource
    return f'{what} "{name}"' if name else what
