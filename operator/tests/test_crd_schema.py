"""The DSV4Deployment CRD: structural, valid samples accepted, invalid ones rejected by field.

Validation here is offline (support/crd_support.py): OpenAPI via jsonschema, unknown fields, and
our CEL rules through a small interpreter. The API server's own CEL compiler and cost limits are
only exercised by e2e/ on a real cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from repo_paths import CRD_FILE, SAMPLES
from support import crd_support as S

CRD: dict[str, Any] = S.load_yaml(CRD_FILE)
SCHEMA: dict[str, Any] = S.crd_schema(CRD)
K8S_VERSIONS = ("1.30", "1.37")


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path or "<root>", schema)]
    for key, sub in schema.get("properties", {}).items():
        nodes += _walk(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            nodes += _walk(schema[key], f"{path}.{key}")
    return nodes


# --- the CRD object itself -------------------------------------------------------------------


def test_names_follow_architecture() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "dsv4deployments.serving.dsv4.io"
    assert (spec["group"], spec["scope"]) == ("serving.dsv4.io", "Namespaced")
    names = spec["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (
        "DSV4Deployment",
        "dsv4deployments",
        "dsv4deployment",
    )
    assert names["shortNames"] == ["dsv4"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_crd_object_passes_kubernetes_validate_strict(k8s: str) -> None:
    kubernetes_validate.validate(CRD, k8s, strict=True)


@pytest.mark.parametrize(
    ("path", "node"), _walk(SCHEMA), ids=lambda v: v if isinstance(v, str) else ""
)
def test_schema_is_structural(path: str, node: dict[str, Any]) -> None:
    # Every node has a type unless it is int-or-string or explicitly preserves unknown fields.
    assert (
        node.get("type")
        or node.get("x-kubernetes-int-or-string")
        or node.get("x-kubernetes-preserve-unknown-fields")
    ), f"{path}: no type"
    assert not ({"properties", "additionalProperties"} <= node.keys()), path
    for key in node.get("required", []):
        assert key in node.get("properties", {}), f"{path}: required {key} is not a property"
    assert "nullable" not in node and "$ref" not in node, path
    if "default" in node:
        assert not S.schema_errors(node, node["default"]), f"{path}: invalid default"
    if node.get("x-kubernetes-list-type") == "map":
        items = node["items"]
        for key in node["x-kubernetes-list-map-keys"]:
            assert key in items.get("required", []) or "default" in items["properties"][key]
    for rule in node.get("x-kubernetes-validations", []):
        target = node
        field_path = rule.get("fieldPath", "")
        for part in field_path.split(".")[1:]:
            assert part in target.get("properties", {}), f"{path}: bad fieldPath {rule}"
            target = target["properties"][part]
        assert rule.get("message"), f"{path}: rule without a message"


def test_preserve_unknown_fields_only_for_kopf_state_and_pod_specs() -> None:
    # A podTemplate's spec is a partial PodSpec: the operator checks and merges it. Inside it,
    # the containers, volumes and their security contexts declare what the pod security
    # rules read (their other fields are kept as written).
    preserved = [p for p, n in _walk(SCHEMA) if n.get("x-kubernetes-preserve-unknown-fields")]
    pod_specs = [f".spec.{role}.podTemplate.spec" for role in ("prefill", "decode", "router")]
    assert [p for p in preserved if not p.startswith(tuple(pod_specs))] == [".status.kopf"]
    assert all(any(p == s or p.startswith(s + ".") for s in pod_specs) for p in preserved[:-1])
    assert set(pod_specs) <= set(preserved)


def test_admission_keeps_a_pod_templates_spec_as_written() -> None:
    body = S.load_yaml(SAMPLES / "flash-h200-volcano.yaml")
    admitted = S.admit(body, SCHEMA)
    for role in ("prefill", "decode"):
        assert admitted["spec"][role]["podTemplate"] == body["spec"][role]["podTemplate"]
    body["spec"]["decode"]["podTemplate"]["metadata"]["name"] = "pruned"
    assert "name" not in S.admit(body, SCHEMA)["spec"]["decode"]["podTemplate"]["metadata"]


def test_root_metadata_declares_only_name() -> None:
    # The API server lets root metadata declare name and generateName, nothing else
    # (validateStructuralMetadataInvariants); name is declared for the root rules' fieldPath.
    assert SCHEMA["properties"]["metadata"] == {
        "type": "object",
        "properties": {"name": {"type": "string"}},
    }


def test_printer_columns_point_at_schema_fields() -> None:
    (version,) = CRD["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    names = list(columns)
    assert (names[0], names[-1]) == ("Ready", "Age")
    assert {"Prefill", "Decode", "Max-Context", "Fits"} <= columns.keys()
    for column in columns.values():
        path = column["jsonPath"]
        if path.startswith(".metadata."):
            continue
        node = SCHEMA
        # .status.conditions[?(@.type=="Ready")].status: a filter selects list items.
        for part in re.sub(r"\[\?\(.*?\)\]", "[]", path).lstrip(".").split("."):
            node = node["properties"][part.removesuffix("[]")]
            if part.endswith("[]"):
                node = node["items"]
        assert node["type"] == column["type"] or column["type"] == "string", path


# --- samples ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", S.valid_samples(), ids=lambda p: p.name)
def test_valid_sample_is_accepted(path: Path) -> None:
    obj = S.load_yaml(path)
    assert obj["apiVersion"] == "serving.dsv4.io/v1alpha1" and obj["kind"] == "DSV4Deployment"
    assert S.validate_cr(obj, SCHEMA) == []


def test_valid_samples_cover_cpu_gpu_and_pp() -> None:
    specs = [S.apply_defaults(SCHEMA, S.load_yaml(p))["spec"] for p in S.valid_samples()]
    assert any(s["gpu"]["memoryGiB"] == 0 for s in specs)
    assert any(s["gpu"]["perPod"] > 0 and s["model"].get("preset") for s in specs)
    assert any(s["prefill"]["pipelineParallel"] > 1 and s["gpu"]["perPod"] > 0 for s in specs)
    assert any("configPath" in s["model"] for s in specs)


def test_invalid_samples_exist_for_every_rule_kind() -> None:
    assert len(S.invalid_samples()) >= 15


@pytest.mark.parametrize("path", S.invalid_samples(), ids=lambda p: p.name)
def test_invalid_sample_is_rejected_naming_the_field(path: Path) -> None:
    expected = S.expected_path(path)
    errors = S.validate_cr(S.load_yaml(path), SCHEMA)
    assert errors, f"{path.name} was accepted"
    # Each invalid sample breaks exactly one thing, and every message names that field.
    for error in errors:
        assert error.startswith(f"{expected}: "), (expected, errors)


# --- defaults --------------------------------------------------------------------------------


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{path}.{key}"))
        return out
    return {path.lstrip("."): value}


# The design example sets these on purpose to values other than the defaults.
EXAMPLE_CHOICES = {"spec.prefill.pipelineParallel": 2}


def test_defaults_match_the_design_example() -> None:
    example = (
        S.load_yaml(S.EXAMPLE) if S.EXAMPLE.exists() else S.load_yaml(SAMPLES / "tiny-cpu.yaml")
    )
    minimal = S.load_yaml(SAMPLES / "tiny-minimal.yaml")
    defaulted = _leaves(S.apply_defaults(SCHEMA, minimal))
    given = _leaves(minimal)
    example_leaves = _leaves(example)
    from_defaults = {p: v for p, v in defaulted.items() if p not in given}
    assert from_defaults, "no defaults applied"
    differ = {
        p: example_leaves[p]
        for p, v in from_defaults.items()
        if p in example_leaves
        and (example_leaves[p] != v or type(example_leaves[p]) is not type(v))
    }
    assert differ == EXAMPLE_CHOICES
    # Every default lands on a field the example shows (no hidden knobs in CPU mode), but for
    # the engine, which came after the example (dsv4: the example's own engine).
    assert set(from_defaults) - set(example_leaves) == {
        "spec.speculativeDraftTokens",
        "spec.engine.name",
    }


def test_tiny_cpu_sample_is_the_design_example() -> None:
    if not S.EXAMPLE.exists():
        pytest.skip(f"{S.EXAMPLE} not present (../shared beside the clone)")
    example, sample = S.load_yaml(S.EXAMPLE), S.load_yaml(SAMPLES / "tiny-cpu.yaml")
    assert sample["spec"] == example["spec"]
    assert S.validate_cr(example, SCHEMA) == []


def test_defaulting_fills_nested_objects() -> None:
    obj = S.apply_defaults(SCHEMA, {"spec": {"model": {"preset": "tiny"}, "maxContextTokens": 8}})
    spec = obj["spec"]
    assert spec["gpu"] == {"memoryGiB": 0, "perPod": 0}
    assert spec["kv"] == {"swaRatio": "auto", "transfer": "nixl"}
    assert spec["decode"] == {"replicas": 1, "pipelineParallel": 1, "tensorParallel": 1}
    assert spec["router"] == {"replicas": 1, "port": 8000}


# --- status ----------------------------------------------------------------------------------

STATUS = {
    "observedGeneration": 3,
    "conditions": [
        {
            "type": t,
            "status": s,
            "reason": r,
            "message": "",
            "lastTransitionTime": "2026-11-21T12:00:00Z",
            "observedGeneration": 3,
        }
        for t, s, r in [
            ("Ready", "False", "PodsNotReady"),
            ("Progressing", "True", "RollingOut"),
            ("Degraded", "False", "AsExpected"),
            ("PlanValid", "True", "Planned"),
            ("ContextFits", "False", "InsufficientKVCapacity"),
            ("KVTransferReady", "Unknown", "Pending"),
        ]
    ],
    "roles": {
        role: {"replicas": 2, "readyReplicas": 1, "ready": "1/2"}
        for role in ("prefill", "decode", "router")
    },
    "plan": [
        {
            "role": "prefill",
            "ppRank": rank,
            "layers": [rank * 4, rank * 4 + 4],
            "bytesPerFullToken": 28.0,
            "bytesPerSwaToken": 576.0,
            "bytesPerRequest": 4096,
            "weightBytes": 655360,
            "kvBytes": 17890752,
            "fullTokens": 524288,
            "swaTokens": 4640,
            "maxRunningRequests": 128,
            "maxContextTokens": 4096,
            "bottleneck": rank == 1,
            "observed": {"fullTokens": 524000, "swaTokens": 4640, "maxRunningRequests": 128},
        }
        for rank in (0, 1)
    ],
    "maxContextTokens": 3072,
    "endpoint": "http://tiny-router.default.svc:8000",
}


def test_status_document_validates_and_nothing_is_pruned() -> None:
    status_schema = SCHEMA["properties"]["status"]
    assert S.schema_errors(status_schema, STATUS) == []
    assert S.unknown_fields(status_schema, STATUS) == []


def test_status_rejects_bad_condition_status() -> None:
    status_schema = SCHEMA["properties"]["status"]
    bad = {"conditions": [{"type": "Ready", "status": "Yes"}]}
    assert any(e.startswith("conditions[0].status") for e in S.schema_errors(status_schema, bad))


def test_conditions_are_a_map_keyed_by_type() -> None:
    conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
