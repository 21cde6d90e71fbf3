"""The fake API server refuses CRDs as the real one does (support/crd_rules.py, each rule cited
from kubernetes/apiextensions-apiserver), and our CRD passes those rules."""

from __future__ import annotations

import copy
import http.client
import json
from typing import Any

import pytest
from repo_paths import CRD_FILE
from support import crd_rules
from support.fake_apiserver import ApiError, FakeApiServer, load_crd

CRD = load_crd(CRD_FILE)
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_our_crd_passes_the_api_servers_rules() -> None:
    assert crd_rules.crd_errors(CRD) == []


def test_a_root_field_path_into_undeclared_metadata_is_refused() -> None:
    # The CRD as it was before metadata declared `name`: every API server >= 1.28 refused it.
    old = copy.deepcopy(CRD)
    _schema(old)["properties"]["metadata"] = {"type": "object"}
    errors = crd_rules.crd_errors(old)
    assert len(errors) == 3 and all("'.metadata.name': must be a valid path" in e for e in errors)
    with pytest.raises(ApiError) as refused:
        FakeApiServer([old])
    assert refused.value.code == 422 and "must be a valid path" in refused.value.message


def test_the_refusal_travels_over_the_wire_and_nothing_is_served() -> None:
    old = copy.deepcopy(CRD)
    _schema(old)["properties"]["metadata"] = {"type": "object"}
    with FakeApiServer() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            conn.request("POST", CRDS, body=json.dumps(old))
            resp = conn.getresponse()
            body = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 422 and body["kind"] == "Status", body
        assert "fieldPath: Invalid value: '.metadata.name'" in body["message"]
        assert server.list("apiextensions.k8s.io/v1", "CustomResourceDefinition") == []


@pytest.mark.parametrize(
    ("metadata", "allowed"),
    [
        ({"type": "object"}, True),
        ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}}}, True),
        (
            {
                "type": "object",
                "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
            },
            True,
        ),
        ({"type": "object", "properties": {"labels": {"type": "object"}}}, False),
        ({"type": "object", "description": "x"}, False),
        ({"type": "string"}, False),
    ],
)
def test_root_metadata_may_restrict_only_name_and_generate_name(
    metadata: dict[str, Any], allowed: bool
) -> None:
    schema = {"type": "object", "properties": {"metadata": metadata}}
    assert (crd_rules.schema_errors(schema) == []) is allowed


def test_metadata_below_the_root_is_an_ordinary_field() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "metadata": {"type": "object", "properties": {"labels": {"type": "object"}}}
                },
            }
        },
    }
    assert crd_rules.schema_errors(schema) == []


@pytest.mark.parametrize(
    ("path", "valid"),
    [
        (".spec", True),
        (".spec.replicas", True),
        (".spec['replicas']", True),
        (".spec.items[0].port", True),
        (".spec.labels.anykey", True),  # a map: any key is a path
        (".spec.missing", False),
        (".spec.replicas.deeper", False),
        (".spec.items.port", False),
        ("spec", False),
        ("", False),
    ],
)
def test_field_paths_follow_cel_valid_field_path(path: str, valid: bool) -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "replicas": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "items": {"type": "object", "properties": {"port": {"type": "integer"}}},
                    },
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            }
        },
    }
    assert crd_rules.field_path_valid(schema, path) is valid


def test_rule_messages_are_checked() -> None:
    rules = [
        {"rule": ""},
        {"rule": "self.a > 0", "message": "   "},
        {"rule": "self.a >\n0"},
        {"rule": "self.a > 0", "fieldPath": ".a\n"},
    ]
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "x-kubernetes-validations": rules,
    }
    errors = crd_rules.schema_errors(schema)
    assert [e.split(": ")[0].rsplit(".", 1)[-1] for e in errors] == [
        "rule",
        "message",
        "message",
        "fieldPath",
    ], errors
