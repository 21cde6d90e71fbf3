"""`x-kubernetes-list-type` and `x-kubernetes-map-type`: what the API server refuses in a CRD's
schema, and the duplicates it refuses in an object on write; pure. Restated from
kubernetes/apiextensions-apiserver:

- `schema_errors` (one schema node): pkg/apis/apiextensions/validation/validation.go,
  ValidateCustomResourceDefinitionOpenAPISchema and validateMapListKeysMapSet: a list type
  only on arrays and one of atomic, set, map; list-map-keys only with (and required by) type
  map, whose items are objects and whose keys are distinct names of scalar item properties,
  each required or defaulted and not nullable; the items of a set or map list are not
  nullable; the items of a set are atomic (an array item of list type atomic, an object item
  of map type atomic: requireAtomicSetType, on for every new CRD); a map type only on objects
  and one of atomic, granular.
- `duplicates` (an object): pkg/apiserver/schema/listtype/validation.go,
  ValidateListSetsAndMaps: no two items of a set are equal, no two items of a map list have
  the same keys (a missing key counts as a value of its own); items of a map list are objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

Schema = Mapping[str, Any]


def _node_errors(schema: Schema, path: str) -> Iterator[str]:
    list_type, kind = schema.get("x-kubernetes-list-type"), schema.get("type")
    keys = list(schema.get("x-kubernetes-list-map-keys") or [])
    items = schema.get("items") if isinstance(schema.get("items"), Mapping) else None
    map_type = schema.get("x-kubernetes-map-type")
    if map_type is not None and kind != "object":
        yield _typed(path, kind, "must be object if x-kubernetes-map-type is specified")
    if map_type is not None and map_type not in ("atomic", "granular"):
        yield (
            f'{path}.x-kubernetes-map-type: Unsupported value: "{map_type}": supported values: '
            '"atomic", "granular"'
        )
    if list_type is not None and kind != "array":
        yield _typed(path, kind, "must be array if x-kubernetes-list-type is specified")
    elif list_type == "set" and items is not None:
        item_list_type = items.get("x-kubernetes-list-type", "atomic")
        if items.get("type") == "array" and item_list_type != "atomic":
            yield (
                f"{path}.items.x-kubernetes-list-type: Invalid value: "
                f'"{item_list_type}": must be atomic as item of a list with '
                "x-kubernetes-list-type=set"
            )
        if items.get("type") == "object" and items.get("x-kubernetes-map-type") != "atomic":
            yield (
                f'{path}.items.x-kubernetes-map-type: Invalid value: "{list_type}": must be '
                "atomic as item of a list with x-kubernetes-list-type=set"
            )
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        yield (
            f'{path}.x-kubernetes-list-type: Unsupported value: "{list_type}": supported '
            'values: "atomic", "set", "map"'
        )
    if keys and list_type is None:
        yield (
            f"{path}.x-kubernetes-list-type: Required value: must be map if "
            "x-kubernetes-list-map-keys is non-empty"
        )
    elif keys and list_type != "map":
        yield (
            f'{path}.x-kubernetes-list-type: Invalid value: "{list_type}": must be map if '
            "x-kubernetes-list-map-keys is non-empty"
        )
    if list_type == "map":
        yield from _map_list_errors(path, keys, items)
    if list_type in ("set", "map") and items is not None and items.get("nullable"):
        yield (
            f"{path}.items.nullable: Forbidden: cannot be nullable when x-kubernetes-list-type "
            f"is {list_type}"
        )


def _typed(path: str, kind: Any, detail: str) -> str:
    if not kind:
        return f"{path}.type: Required value: {detail}"
    return f'{path}.type: Invalid value: "{kind}": {detail}'


def _map_list_errors(path: str, keys: list[str], items: Schema | None) -> Iterator[str]:
    if not keys:
        yield (
            f"{path}.x-kubernetes-list-map-keys: Required value: must not be empty if "
            "x-kubernetes-list-type is map"
        )
    if items is None:
        yield f"{path}.items: Required value: must have a schema if x-kubernetes-list-type is map"
        return
    if items.get("type") != "object":
        yield (
            f'{path}.items.type: Invalid value: "{items.get("type", "")}": must be object if '
            "parent array's x-kubernetes-list-type is map"
        )
        return
    props, required = items.get("properties") or {}, set(items.get("required") or [])
    named = json.dumps(keys)
    for i, key in enumerate(keys):
        prop = props.get(key)
        where = f"{path}.items.properties[{key}]"
        if prop is None:
            yield (
                f"{path}.x-kubernetes-list-map-keys: Invalid value: {named}: entries must all be "
                "names of item properties"
            )
        elif prop.get("type") in ("array", "object"):
            yield (
                f'{where}.type: Invalid value: "object": must be a scalar type if parent '
                "array's x-kubernetes-list-type is map"
            )
        if key in keys[:i]:
            yield (
                f"{path}.x-kubernetes-list-map-keys: Invalid value: {named}: must not contain "
                "duplicate entries"
            )
        if prop is not None and key not in required and "default" not in prop:
            yield (
                f"{where}.default: Required value: this property is in "
                "x-kubernetes-list-map-keys, so it must have a default or be a required property"
            )
        if prop is not None and prop.get("nullable"):
            yield (
                f"{where}.nullable: Forbidden: this property is in x-kubernetes-list-map-keys, "
                "so it cannot be nullable"
            )


def schema_errors(schema: Schema, path: str) -> list[str]:
    """The refusals for one schema node (the caller walks the tree)."""
    return list(_node_errors(schema, path))


# ---------------------------------------------------------------------------------------------
# Objects


def _identity(value: Any) -> str:
    """Equal values, compared as Go compares decoded JSON: 1 and 1.0 and True all differ."""
    return json.dumps(_tagged(value), sort_keys=True)


def _tagged(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    return [type(value).__name__, value]


def duplicates(schema: Schema, value: Any, path: str = "") -> list[str]:
    """`<path>[i]: Duplicate value: ...` for each set item or map-list key seen before, at any
    depth of `value` (an object of `schema`)."""
    out: list[str] = []
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                out.extend(duplicates(sub, item, f"{path}.{key}" if path else key))
    elif isinstance(value, list):
        out.extend(_list_duplicates(schema, value, path))
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                out.extend(duplicates(items, item, f"{path}[{i}]"))
    return out


def _list_duplicates(schema: Schema, value: list[Any], path: str) -> list[str]:
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "set":
        return [
            f"{path}[{i}]: Duplicate value: {json.dumps(value[i])}"
            for i in _second_appearances([_identity(item) for item in value])
        ]
    if list_type != "map":
        return []
    for i, item in enumerate(value):
        if item is not None and not isinstance(item, dict):
            return [f"{path}[{i}]: Invalid value: must be an object for an array of list-type map"]
    keys = list(schema.get("x-kubernetes-list-map-keys") or [])
    present = [{k: (item or {})[k] for k in keys if k in (item or {})} for item in value]
    # A missing key is a value of its own, unlike any present one.
    identities = [json.dumps([[k in p, _tagged(p.get(k))] for k in keys]) for p in present]
    return [
        f"{path}[{i}]: Duplicate value: {json.dumps(present[i])}"
        for i in _second_appearances(identities)
    ]


def _second_appearances(identities: list[str]) -> list[int]:
    """validateListSet: the index of each value's second appearance (not its later ones)."""
    seen: dict[str, int] = {}
    out = []
    for i, identity in enumerate(identities):
        seen[identity] = seen.get(identity, 0) + 1
        if seen[identity] == 2:
            out.append(i)
    return out
