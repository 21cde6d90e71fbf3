"""List types: the API server refuses a CRD whose `x-kubernetes-list-type` / list-map-keys are
inconsistent, and an object with two equal set items or two map-list items with the same keys
(support/list_types.py cites apiextensions-apiserver's validation.go and listtype/validation.go).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from repo_paths import CRD_FILE, ROOT
from support import crd_rules, list_types
from support import crd_support as S
from support.fake_apiserver import ApiError, FakeApiServer

from dsv4_operator import labels as L

ITEM = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "port": {"type": "integer", "default": 80},
        "extra": {"type": "object"},
        "note": {"type": "string"},
    },
}


def errors_of(schema: dict[str, Any]) -> list[str]:
    return list_types.schema_errors(schema, "x")


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        (
            {"type": "object", "x-kubernetes-list-type": "set"},
            'x.type: Invalid value: "object": must be array if x-kubernetes-list-type is specified',
        ),
        (
            {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "bag"},
            'x.x-kubernetes-list-type: Unsupported value: "bag"',
        ),
        (
            {"type": "array", "items": ITEM, "x-kubernetes-list-map-keys": ["name"]},
            "x.x-kubernetes-list-type: Required value: must be map if x-kubernetes-list-map-keys",
        ),
        (
            {"type": "array", "items": ITEM, "x-kubernetes-list-type": "map"},
            "x.x-kubernetes-list-map-keys: Required value: must not be empty",
        ),
        (
            {
                "type": "array",
                "items": {"type": "string"},
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            'x.items.type: Invalid value: "string": must be object if parent array\'s',
        ),
        (
            {
                "type": "array",
                "items": ITEM,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["id"],
            },
            "entries must all be names of item properties",
        ),
        (
            {
                "type": "array",
                "items": ITEM,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["extra"],
            },
            'x.items.properties[extra].type: Invalid value: "object": must be a scalar type',
        ),
        (
            {
                "type": "array",
                "items": ITEM,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["note"],
            },
            "x.items.properties[note].default: Required value: this property is in "
            "x-kubernetes-list-map-keys, so it must have a default or be a required property",
        ),
        (
            {
                "type": "array",
                "items": ITEM,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name", "name"],
            },
            "must not contain duplicate entries",
        ),
        (
            {"type": "array", "items": ITEM, "x-kubernetes-list-type": "set"},
            'x.items.x-kubernetes-map-type: Invalid value: "set": must be atomic as item of a '
            "list with x-kubernetes-list-type=set",
        ),
        (
            {
                "type": "array",
                "x-kubernetes-list-type": "set",
                "items": {"type": "string", "nullable": True},
            },
            "x.items.nullable: Forbidden: cannot be nullable when x-kubernetes-list-type is set",
        ),
        (
            {"type": "array", "items": {"type": "string"}, "x-kubernetes-map-type": "atomic"},
            'x.type: Invalid value: "array": must be object if x-kubernetes-map-type',
        ),
    ],
)
def test_inconsistent_list_types_are_refused(schema: dict[str, Any], error: str) -> None:
    assert any(error in e for e in errors_of(schema)), errors_of(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "array",
            "items": ITEM,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name", "port"],  # required, defaulted
        },
        {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
        {
            "type": "array",
            "x-kubernetes-list-type": "set",
            "items": {**ITEM, "x-kubernetes-map-type": "atomic"},
        },
        {"type": "array", "items": ITEM, "x-kubernetes-list-type": "atomic"},
        {"type": "object", "x-kubernetes-map-type": "granular"},
    ],
)
def test_consistent_list_types_are_accepted(schema: dict[str, Any]) -> None:
    assert errors_of(schema) == []


def test_our_crd_and_the_add_ons_crds_pass() -> None:
    """prometheus-operator's CRDs use many map and set lists; real servers accept them."""
    paths = [CRD_FILE, *sorted((ROOT / "operator" / "tests" / "data").glob("*/*.yaml"))]
    crds = [
        d
        for path in paths
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "CustomResourceDefinition"
    ]
    assert len(crds) == 5
    for crd in crds:
        assert crd_rules.crd_errors(crd) == [], crd["metadata"]["name"]


def test_the_fake_refuses_a_crd_with_a_map_list_keyed_by_an_optional_field() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    status["properties"]["conditions"]["items"]["required"] = ["status"]  # type no longer
    with FakeApiServer() as server, pytest.raises(ApiError) as info:
        server.create(crd)
    assert info.value.code == 422
    assert "properties[conditions].items.properties[type].default: Required value" in str(
        info.value
    )


# ---------------------------------------------------------------------------------------------
# Objects


SCHEMA = S.crd_schema()


def _status(**status: Any) -> dict[str, Any]:
    return {"status": status}


def test_duplicate_condition_types_and_restarting_groups_are_refused() -> None:
    ready = {"type": "Ready", "status": "True"}
    assert list_types.duplicates(SCHEMA, _status(conditions=[ready, {**ready}])) == [
        'status.conditions[1]: Duplicate value: {"type": "Ready"}'
    ]
    assert list_types.duplicates(SCHEMA, _status(restartingGroups=["a", "b", "a", "a"])) == [
        'status.restartingGroups[2]: Duplicate value: "a"'
    ]
    plan = [{"role": "prefill", "ppRank": 0}, {"role": "prefill", "ppRank": 1}]
    assert list_types.duplicates(SCHEMA, _status(plan=plan)) == []
    assert list_types.duplicates(SCHEMA, _status(plan=[*plan, plan[1]])) == [
        'status.plan[2]: Duplicate value: {"role": "prefill", "ppRank": 1}'
    ]


def test_the_fake_refuses_a_status_write_with_duplicate_keys() -> None:
    with FakeApiServer(crd_admission=S.crd_admission) as server:
        server.create(yaml.safe_load(CRD_FILE.read_text()))
        cr = yaml.safe_load((ROOT / "crds" / "samples" / "tiny-pd.yaml").read_text())
        cr["metadata"]["namespace"] = "default"
        server.create(cr)
        ready = {"type": "Ready", "status": "True"}
        with pytest.raises(ApiError) as info:
            server.set_status(
                L.API_VERSION, L.KIND, "default", "tiny-pd", {"conditions": [ready] * 2}
            )
        assert info.value.code == 422
        assert "status.conditions[1]: Duplicate value" in info.value.message
        server.set_status(L.API_VERSION, L.KIND, "default", "tiny-pd", {"conditions": [ready]})


SET_SCHEMA = {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "integer"}}
MAP_SCHEMA = {
    "type": "array",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["k"],
    "items": {"type": "object", "properties": {"k": {"type": "integer"}}},
}


@given(st.lists(st.integers(0, 4), max_size=10))
def test_a_set_reports_each_repeated_value_once_at_its_second_appearance(items: list[int]) -> None:
    errors = list_types.duplicates({"properties": {"s": SET_SCHEMA}}, {"s": items})
    second = [i for i, v in enumerate(items) if items[: i + 1].count(v) == 2]
    assert errors == [f"s[{i}]: Duplicate value: {items[i]}" for i in second]


@given(st.lists(st.one_of(st.none(), st.integers(0, 3)), max_size=8))
def test_a_map_list_compares_keys_and_a_missing_key_is_a_value_of_its_own(
    keys: list[int | None],
) -> None:
    items = [{} if k is None else {"k": k, "v": i} for i, k in enumerate(keys)]
    errors = list_types.duplicates({"properties": {"m": MAP_SCHEMA}}, {"m": copy.deepcopy(items)})
    second = [i for i, k in enumerate(keys) if keys[: i + 1].count(k) == 2]
    assert [e.split(":")[0] for e in errors] == [f"m[{i}]" for i in second]


def test_values_of_different_json_types_are_different() -> None:
    schema = {"properties": {"s": {**SET_SCHEMA, "items": {"x-kubernetes-int-or-string": True}}}}
    assert list_types.duplicates(schema, {"s": [1, "1", 1.0, True]}) == []
    assert list_types.duplicates(schema, {"s": [1, 1]}) == ["s[1]: Duplicate value: 1"]
