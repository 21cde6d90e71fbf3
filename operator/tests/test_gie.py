"""The Gateway API Inference Extension objects (`spec.gateway`, `gie.py`): an InferencePool of
the decode groups' serving pods with the endpoint picker the user names, an HTTPRoute to it, a
NetworkPolicy for the gateway's namespaces; pruned when `spec.gateway` goes.

Schema validity, two ways:
  - against the published CRDs (kubernetes-sigs/gateway-api-inference-extension v1.6.0
    `config/crd/bases/inference.networking.k8s.io_inferencepools.yaml`, kubernetes-sigs/
    gateway-api v1.6.1 `config/crd/standard/gateway.networking.k8s.io_httproutes.yaml`), read
    from the folder $DSV4_GATEWAY_CRDS or ../shared/data/gateway-crds (this repository does
    not carry upstream files; the test skips, naming the folder, without them);
  - always, against the fields of those schemas that the objects use, restated below (types,
    required fields, enums, bounds, patterns, no unknown fields).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from repo_paths import ROOT
from support import crd_support as S
from support.fake_apiserver import load_crd

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.gie import POOL_API_VERSION, ROUTE_API_VERSION
from dsv4_operator.objects import build_desired_state
from dsv4_operator.workerconfig import HTTP_PORT, STATUS_PORT

Body = dict[str, Any]
CRD_DIRS = [
    Path(os.environ.get("DSV4_GATEWAY_CRDS", "/nonexistent")),
    ROOT.parent / "shared" / "data" / "gateway-crds",
]
POOL_CRD = "inference.networking.k8s.io_inferencepools.yaml"
ROUTE_CRD = "gateway.networking.k8s.io_httproutes.yaml"

BODY: Body = {
    "apiVersion": L.API_VERSION,
    "kind": L.KIND,
    "metadata": {"name": "tiny", "namespace": "team-a", "uid": "u-1"},
    "spec": {
        "model": {"preset": "tiny"},
        "maxContextTokens": 1024,
        "gateway": {
            "endpointPicker": {"name": "tiny-epp", "failureMode": "FailOpen"},
            "parentRefs": [{"name": "inference-gateway", "namespace": "gateway-system"}],
            "pathPrefix": "/v1",
            "allowFromNamespaces": ["gateway-system"],
        },
    },
}

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {
    "type": "object",
    "minProperties": 1,
    "maxProperties": 64,
    "additionalProperties": {
        "type": "string",
        "maxLength": 63,
        "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
    },
}
POOL_SPEC: Body = {  # InferencePool v1 spec, restated
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "targetPorts"],
    "properties": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "required": ["matchLabels"],
            "properties": {"matchLabels": _LABELS},
        },
        "targetPorts": {
            "type": "array",
            "minItems": 1,
            "maxItems": 8,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["number"],
                "properties": {"number": _PORT},
            },
        },
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "port"],  # port: required when kind is Service (a CEL rule)
            "properties": {
                "name": _NAME,
                "kind": {
                    "type": "string",
                    "maxLength": 63,
                    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                },
                "group": {"type": "string", "maxLength": 253},
                "port": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["number"],
                    "properties": {"number": _PORT},
                },
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
        },
    },
}
ROUTE_SPEC: Body = {  # HTTPRoute v1 spec, the fields used, restated
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "parentRefs": {
            "type": "array",
            "maxItems": 32,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "group": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": _NAME,
                    "namespace": {"type": "string", "maxLength": 63},
                    "sectionName": {"type": "string", "maxLength": 253},
                },
            },
        },
        "rules": {
            "type": "array",
            "maxItems": 16,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "matches": {
                        "type": "array",
                        "maxItems": 64,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "path": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "type": {
                                            "enum": ["Exact", "PathPrefix", "RegularExpression"]
                                        },
                                        "value": {
                                            "type": "string",
                                            "maxLength": 1024,
                                            "pattern": "^/",
                                        },
                                    },
                                }
                            },
                        },
                    },
                    "backendRefs": {
                        "type": "array",
                        "maxItems": 16,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name"],
                            "properties": {
                                "group": {"type": "string"},
                                "kind": {"type": "string"},
                                "name": _NAME,
                                "port": _PORT,
                            },
                        },
                    },
                },
            },
        },
    },
}


def objects(body: Body) -> dict[str, Body]:
    spec = parse_spec(body)
    state = build_desired_state(spec, parse_meta(body), plan_memory(spec))
    return {
        o["kind"]: o
        for o in state.objects
        if o["apiVersion"] in (POOL_API_VERSION, ROUTE_API_VERSION)
        or o["metadata"]["name"].endswith("-gateway")
    }


def test_the_pool_selects_the_decode_serving_pods_with_the_named_endpoint_picker() -> None:
    got = objects(BODY)
    pool = got["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "tiny-pool"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pool["spec"]["selector"]["matchLabels"] == L.serving_selector("tiny", "decode")
    assert pool["spec"]["targetPorts"] == [{"number": HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "tiny-epp",
        "kind": "Service",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    route = got["HTTPRoute"]
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference-gateway",
            "namespace": "gateway-system",
        }
    ]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tiny-pool"}
    ]
    policy = got["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == L.role_selector("tiny", "decode")
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["from"] == [
        {"namespaceSelector": {"matchLabels": {L.NAMESPACE_NAME_LABEL: "gateway-system"}}}
    ]
    assert {p["port"] for p in ingress["ports"]} == {HTTP_PORT, STATUS_PORT}


def test_without_parents_or_namespaces_only_the_pool_is_rendered_and_without_gateway_none() -> None:
    body = copy.deepcopy(BODY)
    body["spec"]["gateway"] = {"endpointPicker": {"name": "epp"}}
    assert set(objects(body)) == {"InferencePool"}
    del body["spec"]["gateway"]
    assert objects(body) == {}


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({}, "spec.gateway.endpointPicker: required"),
        ({"endpointPicker": {"name": "Bad_Name"}}, "spec.gateway.endpointPicker.name"),
        (
            {"endpointPicker": {"name": "e", "failureMode": "Open"}},
            "spec.gateway.endpointPicker.failureMode",
        ),
        (
            {"endpointPicker": {"name": "e"}, "parentRefs": [{}]},
            "spec.gateway.parentRefs[0].name: required",
        ),
        ({"endpointPicker": {"name": "e"}, "pathPrefix": "v1"}, "spec.gateway.pathPrefix"),
        (
            {"endpointPicker": {"name": "e"}, "allowFromNamespaces": ["A"]},
            "spec.gateway.allowFromNamespaces[0]",
        ),
    ],
)
def test_a_bad_gateway_names_its_field(gateway: Body, message: str) -> None:
    body = copy.deepcopy(BODY)
    body["spec"]["gateway"] = gateway
    with pytest.raises(SpecError) as err:
        parse_spec(body)
    assert any(e.startswith(message) for e in err.value.errors), err.value.errors


def test_the_objects_hold_to_the_restated_schemas() -> None:
    got = objects(BODY)
    jsonschema.Draft4Validator(POOL_SPEC).validate(got["InferencePool"]["spec"])
    jsonschema.Draft4Validator(ROUTE_SPEC).validate(got["HTTPRoute"]["spec"])
    bad = copy.deepcopy(got["InferencePool"]["spec"])
    bad["endpointPickerRef"]["port"] = 9002  # the pre-v1 shape (portNumber / a bare port)
    assert list(jsonschema.Draft4Validator(POOL_SPEC).iter_errors(bad))


def _published(name: str) -> Body:
    for folder in CRD_DIRS:
        if (folder / name).is_file():
            return load_crd(folder / name)
    pytest.skip(
        f"{name}: put the published CRD in $DSV4_GATEWAY_CRDS or ../shared/data/gateway-crds"
    )


@pytest.mark.parametrize(
    ("kind", "crd_file"), [("InferencePool", POOL_CRD), ("HTTPRoute", ROUTE_CRD)]
)
def test_the_objects_validate_against_the_published_crds(kind: str, crd_file: str) -> None:
    crd = _published(crd_file)
    obj = objects(BODY)[kind]
    group, version = obj["apiVersion"].split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    defaulted = S.apply_defaults(schema, obj)
    assert S.schema_errors(schema, defaulted) == []
    assert S.unknown_fields(schema, defaulted) == []  # nothing the API server would prune
    if kind == "InferencePool":
        # Its two CEL rules, stated in Python (outside the subset our CEL interpreter runs).
        ref = defaulted["spec"]["endpointPickerRef"]
        assert ref["kind"] != "Service" or "port" in ref
        numbers = [p["number"] for p in defaulted["spec"]["targetPorts"]]
        assert len(numbers) == len(set(numbers))
