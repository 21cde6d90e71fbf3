"""What the real API server checks when a CustomResourceDefinition is created or updated, for the
parts of it our CRD uses. Each check cites the upstream rule it restates (read from
kubernetes/apiextensions-apiserver):

- `pkg/apiserver/schema/validation.go`, validateStructuralInvariants: the root schema is an
  object; `kind` and `apiVersion`, where declared, are strings; the root's metadata is an object
  that restricts nothing but `name` and `generateName` (validateStructuralMetadataInvariants:
  `must not specify anything other than name and generateName`).
- `pkg/apis/apiextensions/validation/validation.go`, ValidateCustomResourceDefinitionOpenAPISchema:
  an `x-kubernetes-validations` rule is non-empty; a message, if given, is non-blank and one
  line; a rule with line breaks needs a message; a `fieldPath` is one line and a valid path into
  the schema of the node that carries the rule (pathValid -> cel.ValidFieldPath: every segment
  must be a declared property, an array index or a map key of an object with
  additionalProperties).
- `pkg/apiserver/schema/cel/compilation.go`, Compile: every rule compiles and type-checks
  against its node's schema, for the CEL subset the tests evaluate (support/cel_check.py).
- List types: `x-kubernetes-list-type`, `-list-map-keys` and `-map-type` are consistent
  (support/list_types.py).

The functions return the API server's messages, field paths as it words them; an empty list
means the CRD is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from support import cel_check, list_types

Schema = Mapping[str, Any]

# cel.ValidFieldPath accepts `.name`, `['name']` and `[index]` segments.
_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\['([^']*)'\]|\[(\d+)\]")


def field_path_valid(schema: Schema, path: str) -> bool:
    """cel.ValidFieldPath: `path` (".a.b", ".a['b']", ".list[0]") names a node of `schema`."""
    node: Schema = schema
    pos = 0
    if not path.startswith((".", "[")):
        return False
    while pos < len(path):
        match = _SEGMENT.match(path, pos)
        if match is None:
            return False
        name = match.group(1) if match.group(1) is not None else match.group(2)
        if name is not None:
            props = node.get("properties") or {}
            if name in props:
                node = props[name]
            elif isinstance(node.get("additionalProperties"), Mapping):
                node = node["additionalProperties"]
            else:
                return False
        else:
            if node.get("type") != "array" or not isinstance(node.get("items"), Mapping):
                return False
            node = node["items"]
        pos = match.end()
    return True


def _walk(schema: Schema, path: str) -> Iterator[tuple[str, Schema]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.properties[{key}]")
    if isinstance(schema.get("items"), Mapping):
        yield from _walk(schema["items"], f"{path}.items")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from _walk(schema["additionalProperties"], f"{path}.additionalProperties")


def _metadata_errors(schema: Schema, path: str, root: bool) -> list[str]:
    """validateStructuralMetadataInvariants: a `metadata` property is free below the root (a
    pod template's metadata is an ordinary field) unless its node embeds a resource."""
    metadata = (schema.get("properties") or {}).get("metadata")
    if metadata is None or not (root or schema.get("x-kubernetes-embedded-resource")):
        return []
    where = f"{path}.properties[metadata]"
    errors = []
    if metadata.get("type") != "object":
        errors.append(f"{where}.type: Invalid value: {metadata.get('type')!r}: must be object")
    if root:
        rest = {k for k in metadata if k not in ("type", "properties")}
        names = set(metadata.get("properties") or {})
        if rest or not names <= {"name", "generateName"}:
            errors.append(
                f"{where}: Forbidden: must not specify anything other than name and "
                "generateName, but metadata is implicitly specified"
            )
    return errors


def _rule_errors(node: Schema, path: str, root: bool = False) -> list[str]:
    errors = []
    embedded = root or bool(node.get("x-kubernetes-embedded-resource"))
    for i, rule in enumerate(node.get("x-kubernetes-validations") or []):
        where = f"{path}.x-kubernetes-validations[{i}]"
        text = str(rule.get("rule", "")).strip()
        message = rule.get("message")
        if not text:
            errors.append(f"{where}.rule: Required value: rule is not specified")
        elif (failed := cel_check.compile_error(text, node, embedded)) is not None:
            errors.append(f"{where}.rule: Invalid value: {text!r}: compilation failed: {failed}")
        if message is not None and not str(message).strip():
            errors.append(f"{where}.message: Invalid value: must be non-empty if specified")
        if message is not None and "\n" in str(message).strip():
            errors.append(f"{where}.message: Invalid value: must not contain line breaks")
        if "\n" in text and not str(message or "").strip():
            errors.append(
                f"{where}.message: Required value: message must be specified if rule contains "
                "line breaks"
            )
        field_path = rule.get("fieldPath")
        if field_path is not None:
            if "\n" in field_path:
                errors.append(f"{where}.fieldPath: Invalid value: must not contain line breaks")
            elif not field_path_valid(node, field_path.strip()):
                errors.append(
                    f"{where}.fieldPath: Invalid value: {field_path!r}: must be a valid path"
                )
    return errors


def schema_errors(schema: Schema, path: str = "openAPIV3Schema") -> list[str]:
    """Every refusal the API server gives for one version's `openAPIV3Schema`."""
    errors = []
    if schema.get("type", "object") != "object":
        errors.append(f"{path}.type: Invalid value: {schema['type']!r}: must be object at the root")
    for key in ("kind", "apiVersion"):
        declared = (schema.get("properties") or {}).get(key)
        if declared is not None and declared.get("type") != "string":
            errors.append(f"{path}.properties[{key}].type: Invalid value: must be string")
    for node_path, node in _walk(schema, path):
        errors.extend(_metadata_errors(node, node_path, root=node_path == path))
        errors.extend(_rule_errors(node, node_path, root=node_path == path))
        errors.extend(list_types.schema_errors(node, node_path))
    return errors


def crd_errors(crd: Mapping[str, Any]) -> list[str]:
    """The API server's refusals for a whole apiextensions.k8s.io/v1 CustomResourceDefinition."""
    errors = []
    for i, version in enumerate(crd.get("spec", {}).get("versions") or []):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is not None:
            errors.extend(schema_errors(schema, f"spec.versions[{i}].schema.openAPIV3Schema"))
    return errors
