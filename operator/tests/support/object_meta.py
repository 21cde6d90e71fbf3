"""ObjectMeta as the API server validates it on every write, and the NamespaceLifecycle
admission plugin's refusal of new content in a terminating namespace; pure.

Restated from kubernetes/apimachinery `pkg/api/validation/objectmeta.go` (ValidateObjectMeta:
the name by the kind's rule, ValidateAnnotations with TotalAnnotationSizeLimitB = 256 KiB,
ValidateLabels), `pkg/util/validation/validation.go` (IsDNS1123Subdomain, IsDNS1123Label,
IsDNS1035Label, IsQualifiedName, IsValidLabelValue and their messages), kubernetes
`pkg/apis/core/validation/validation.go` (Service names are DNS-1035 labels, Namespace names
DNS-1123 labels; ValidateRBACName: path segments) and `plugin/pkg/admission/namespace/lifecycle/
admission.go` (a create in a namespace whose phase is Terminating: 403 Forbidden, cause
NamespaceTerminating).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

TOTAL_ANNOTATION_SIZE_LIMIT_B: Final = 256 * 1024
_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_1123: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_1035: Final = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_NAME: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE: Final = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")

SUBDOMAIN_MSG: Final = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_1123_MSG: Final = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_1035_MSG: Final = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
NAMESPACE_TERMINATING: Final = "NamespaceTerminating"  # metav1 StatusCause type


def _subdomain(name: str) -> list[str]:
    errors = []
    if len(name) > 253:
        errors.append("must be no more than 253 characters")
    if not _SUBDOMAIN.fullmatch(name):
        errors.append(SUBDOMAIN_MSG)
    return errors


def _label(pattern: re.Pattern[str], message: str) -> Callable[[str], list[str]]:
    def check(name: str) -> list[str]:
        errors = []
        if len(name) > 63:
            errors.append("must be no more than 63 characters")
        if not pattern.fullmatch(name):
            errors.append(message)
        return errors

    return check


def _path_segment(name: str) -> list[str]:
    if name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]


# The name rule of each resource (group, plural); every other kind: a DNS-1123 subdomain.
_NAME_RULES: Final[dict[tuple[str, str], Callable[[str], list[str]]]] = {
    ("", "services"): _label(_LABEL_1035, LABEL_1035_MSG),
    ("", "namespaces"): _label(_LABEL_1123, LABEL_1123_MSG),
    **{
        ("rbac.authorization.k8s.io", plural): _path_segment
        for plural in ("roles", "rolebindings", "clusterroles", "clusterrolebindings")
    },
}


def _qualified_name(key: str) -> list[str]:
    prefix, slash, name = key.rpartition("/")
    errors = []
    if slash and (not prefix or _subdomain(prefix)):
        errors.append("prefix part " + SUBDOMAIN_MSG)
    if not name or len(name) > 63 or not _NAME.fullmatch(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
            "'123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
        )
    return errors


def _quote(value: object) -> str:
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def meta_errors(group: str, plural: str, meta: Mapping[str, Any]) -> list[str]:
    """ValidateObjectMeta's field errors, "<path>: <type>: <detail>" as the server words them."""
    errors: list[str] = []
    name = meta.get("name")
    if isinstance(name, str) and name:
        check = _NAME_RULES.get((group, plural), _subdomain)
        errors += [f"metadata.name: Invalid value: {_quote(name)}: {e}" for e in check(name)]
    labels = meta.get("labels") or {}
    for key, value in labels.items():
        errors += [
            f"metadata.labels: Invalid value: {_quote(key)}: {e}" for e in _qualified_name(key)
        ]
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            errors.append(
                f"metadata.labels: Invalid value: {_quote(value)}: a valid label must be an empty "
                "string or consist of alphanumeric characters, '-', '_' or '.', and must start "
                "and end with an alphanumeric character, at most 63 characters"
            )
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += [
            f"metadata.annotations: Invalid value: {_quote(key)}: {e}"
            for e in _qualified_name(key.lower())
        ]
    size = sum(len(k.encode()) + len(str(v).encode()) for k, v in annotations.items())
    if size > TOTAL_ANNOTATION_SIZE_LIMIT_B:
        errors.append(
            f"metadata.annotations: Too long: may not be more than {TOTAL_ANNOTATION_SIZE_LIMIT_B} "
            "bytes"
        )
    return errors


def invalid_message(group: str, kind: str, name: str, errors: list[str]) -> str:
    """StatusError NewInvalid's message: `<Kind>[.group] "<name>" is invalid: <errors>`."""
    qualified = f"{kind}.{group}" if group else kind
    joined = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    return f'{qualified} "{name}" is invalid: {joined}'


def terminating_refusal(
    group: str, plural: str, name: str, namespace: str
) -> tuple[str, dict[str, Any]]:
    """NamespaceLifecycle's 403 for a create in a terminating namespace: (message, details)."""
    resource = f"{plural}.{group}" if group else plural
    why = f"unable to create new content in namespace {namespace} because it is being terminated"
    details = {
        "name": name,
        "group": group,
        "kind": plural,
        "causes": [
            {
                "reason": NAMESPACE_TERMINATING,
                "message": f"namespace {namespace} is being terminated",
                "field": "metadata.namespace",
            }
        ],
    }
    return f'{resource} "{name}" is forbidden: {why}', details
