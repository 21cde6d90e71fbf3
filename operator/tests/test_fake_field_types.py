"""The fake API server's schema table (support/field_types.py) says what the real server's
OpenAPI says, for every field of every object the operator renders from the samples: keyed
lists and their keys, sets, atomic lists and maps, map keys versus struct fields, strategic
merge keys, quantities. The reference is the v1.37 OpenAPI schema that kubernetes-validate
ships (the definitions the API server builds its structured-merge schema from)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from repo_paths import CRD_FILE
from support import field_types as T
from support.rendered import rendered_objects

_SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
_QUANTITY_REF = "io.k8s.apimachinery.pkg.api.resource.Quantity"


def _definitions() -> dict[str, Any]:
    newest = max(
        (p for p in _SCHEMAS.iterdir() if p.name.endswith("-local")),
        key=lambda p: tuple(int(x) for x in p.name[1:].split("-")[0].split(".")),
    )
    defs: dict[str, Any] = json.loads((newest / "_definitions.json").read_text())["$defs"]
    return defs


DEFS = _definitions()


def _resolve(schema: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    ref = ""
    while "$ref" in schema:
        ref = schema["$ref"].rsplit("/", 1)[-1]
        schema = DEFS[ref]
    return schema, ref


def _root(api_version: str, kind: str) -> Mapping[str, Any] | None:
    group, _, version = api_version.rpartition("/")
    for definition in DEFS.values():
        for gvk in definition.get("x-kubernetes-group-version-kind", ()):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, version, kind):
                return definition  # type: ignore[no-any-return]
    return None


def _mismatches(
    schema: Mapping[str, Any], ours: T.FieldType, value: Any, path: str, granular: bool
) -> Iterator[str]:
    """What our type says differently from the upstream schema, at `value` and below
    (`granular`: no atomic node above, so list and map semantics matter here)."""
    schema, ref = _resolve(schema)
    if (ref == _QUANTITY_REF) != ours.quantity:
        yield f"{path}: quantity upstream={ref == _QUANTITY_REF} ours={ours.quantity}"
    if isinstance(value, dict):
        atomic = schema.get("x-kubernetes-map-type") == "atomic"
        if granular and atomic != ours.atomic:
            yield f"{path}: atomic map upstream={atomic} ours={ours.atomic}"
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, child in value.items():
            declared = key in props
            if granular and (not declared) != (not ours.is_field(key)):
                yield f"{path}.{key}: map key upstream={not declared} ours={not ours.is_field(key)}"
            sub = props.get(key) or (extra if isinstance(extra, Mapping) else {})
            yield from _mismatches(
                sub, ours.child(key), child, f"{path}.{key}", granular and not atomic
            )
    elif isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type", "atomic")
        keys = tuple(schema.get("x-kubernetes-list-map-keys") or ())
        upstream = None if list_type == "atomic" else () if list_type == "set" else keys
        if granular and upstream != ours.keys:
            yield f"{path}: list keys upstream={upstream} ours={ours.keys}"
        strategies = (schema.get("x-kubernetes-patch-strategy") or "").split(",")
        merge_key = schema.get("x-kubernetes-patch-merge-key")
        upstream_smp, our_smp = (
            ("merge" in strategies, merge_key),
            (ours.merge_list, ours.merge_key),
        )
        if upstream_smp != our_smp:
            yield f"{path}: strategic merge upstream={upstream_smp} ours={our_smp}"
        for item in value:
            yield from _mismatches(
                schema.get("items") or {},
                ours.item(),
                item,
                f"{path}[]",
                granular and upstream is not None,
            )


def test_the_table_matches_the_upstream_openapi_for_every_rendered_field() -> None:
    seen: set[str] = set()
    problems: set[str] = set()
    for obj in rendered_objects():
        root = _root(obj["apiVersion"], obj["kind"])
        if root is None:
            continue  # an add-on's kind (Volcano's PodGroup): not built in
        seen.add(obj["kind"])
        ours = T.builtin(obj["apiVersion"], obj["kind"])
        problems.update(_mismatches(root, ours, obj, obj["kind"], True))
    assert seen >= {"StatefulSet", "Deployment", "Service", "ConfigMap", "NetworkPolicy"}
    assert not problems, sorted(problems)


_STRINGS = {"type": "string"}
_KEYED = {
    "type": "array",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["a", "b"],
    "items": {"type": "object", "properties": {"a": _STRINGS}},
}


@pytest.mark.parametrize(
    ("schema", "keys", "free_keys", "atomic"),
    [
        ({"type": "array", "items": _STRINGS}, None, False, False),
        ({"type": "array", "x-kubernetes-list-type": "set", "items": _STRINGS}, (), False, False),
        (_KEYED, ("a", "b"), False, False),
        ({"type": "object", "additionalProperties": _STRINGS}, None, True, False),
        (
            {"type": "object", "x-kubernetes-map-type": "atomic", "properties": {}},
            None,
            False,
            True,
        ),
        ({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, None, True, False),
    ],
)
def test_crd_schemas_give_the_list_and_map_types_they_declare(
    schema: dict[str, Any], keys: tuple[str, ...] | None, free_keys: bool, atomic: bool
) -> None:
    ours = T.from_openapi(schema)
    assert (ours.keys, ours.free_keys, ours.atomic) == (keys, free_keys, atomic)


def test_our_crd_keyed_lists_are_read_from_the_crd() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    version = crd["spec"]["versions"][0]["name"]
    status = T.custom_resource(crd, version).child("status")
    assert status.child("conditions").keys == ("type",)
    assert status.child("plan").keys == ("role", "ppRank")
    assert T.custom_resource(crd, version).child("metadata") is T.META
