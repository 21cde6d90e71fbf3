"""CEL rules are compiled and type-checked when a CRD is created, as the API server does
(support/cel_check.py cites apiextensions-apiserver's compilation.go and apiserver's
SchemaDeclType): a rule naming a field the schema does not declare, or comparing values of
different types, is refused with 422; a rule outside the subset our interpreter evaluates is
refused too, so every rule the tests accept is one they check."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from repo_paths import CRD_FILE, ROOT
from support import cel_check
from support import crd_support as S
from support.chart_install import request
from support.fake_apiserver import FakeApiServer

OBJECT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "replicas": {"type": "integer"},
        "ratio": {"type": "number"},
        "enabled": {"type": "boolean"},
        "since": {"type": "string", "format": "date-time"},
        "args": {"type": "array", "items": {"type": "string"}},
        "limits": {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True}},
        "gpu": {"type": "object", "properties": {"perPod": {"type": "integer"}}},
        "opaque": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "untyped": {"x-kubernetes-preserve-unknown-fields": True},
    },
}


def compile_error(rule: str, schema: dict[str, Any] = OBJECT, root: bool = False) -> str | None:
    return cel_check.compile_error(rule, schema, root)


def test_every_rule_of_our_crd_and_the_add_on_crds_compiles() -> None:
    crds = [yaml.safe_load(CRD_FILE.read_text())]
    crds += [
        d
        for path in sorted((ROOT / "operator" / "tests" / "data").glob("*/*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "CustomResourceDefinition"
    ]
    checked = 0
    for crd in crds:
        for version in crd["spec"]["versions"]:
            schema = version["schema"]["openAPIV3Schema"]
            for node, rules in _rule_nodes(schema, root=True):
                for rule in rules:
                    assert compile_error(rule["rule"], node[0], node[1]) is None, rule
                    checked += 1
    # All ours (the add-ons' CRDs have none today): 42 (5 of them autoscaling's, 1 the
    # mooncake-needs-sglang rule, 1 the sglang-dtype-is-auto rule, 6 the model source's), and 33
    # in each role's podTemplate (3 on the pod, 2 on a volume, 14 on a container and its init
    # containers each).
    assert checked == 42 + 3 * 33


def _rule_nodes(schema: dict[str, Any], root: bool) -> Iterator[tuple[Any, list[Any]]]:
    if schema.get("x-kubernetes-validations"):
        yield (schema, root), schema["x-kubernetes-validations"]
    for sub in (schema.get("properties") or {}).values():
        yield from _rule_nodes(sub, False)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _rule_nodes(schema[key], False)


@pytest.mark.parametrize(
    "rule",
    [
        "self.replicas > 0",
        "self.ratio >= 0.5",
        "self.name.size() <= 40 && self.name.startsWith('a') && !self.name.contains('.')",
        "self.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "has(self.gpu.perPod) ? self.gpu.perPod == self.replicas : true",
        "self.args.size() == self.replicas",
        "'nvidia.com/gpu' in self.limits",
        "!has(self.limits) || self.limits.size() < 3",
        "has(self.limits.cpu)",  # has() on a map: a key test
        "self.limits.cpu == 1 || self.limits.cpu == '1'",  # int-or-string is dyn
        "'--x' in self.args",
        "self.since < self.since",  # timestamps are ordered
        "self.enabled == true",
    ],
)
def test_well_typed_rules_compile(rule: str) -> None:
    assert compile_error(rule) is None


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        ("self.replicaz > 0", "undefined field 'replicaz'"),
        ("has(self.gpu.count)", "undefined field 'count'"),
        ("self.gpu.perPod.size() > 0", "found no matching overload for 'size' applied to 'int.()'"),
        ("self.name == 1", "found no matching overload for '_==_' applied to '(string, int)'"),
        (
            "self.replicas == 1.0",
            "found no matching overload for '_==_' applied to '(int, double)'",
        ),
        ("self.name < 1", "found no matching overload for '_<_' applied to '(string, int)'"),
        ("self.replicas && true", "found no matching overload for '_&&_' applied to '(int, bool)'"),
        ("!self.name", "found no matching overload for '!_' applied to '(string)'"),
        ("1 in self.args", "found no matching overload for '@in' applied to '(int, list(string))'"),
        ("self.args.contains('x')", "found no matching overload for 'contains'"),
        ("self.name.startsWith(1)", "found no matching overload for 'startsWith'"),
        ("self.replicas > 0 ? 'a' : 1", "found no matching overload for '_?_:_'"),
        ("has(self.name.first)", "invalid argument to has() macro"),
        ("self.replicas", "cel expression must evaluate to a bool"),
        ("self.limits.cpu", "cel expression must evaluate to a bool"),  # dyn is not bool
        ("self.name.matches('(?=a)')", "invalid regex"),
        ("self.name.matches('(')", "invalid regex"),
        # undeclared fields of preserve-unknown-fields objects are not exposed
        ("has(self.opaque.anything)", "undefined field 'anything'"),
        ("self.untyped == 1", "undefined field 'untyped'"),
        # outside the subset: refused, never waved through
        ("self.ratio > 0", "mixes int and double"),
        ("self.enabled < true", "outside the CEL subset"),
        ("self.name.endsWith('x')", "outside the CEL subset"),
        ("self.args.all(a, a != '')", "outside the CEL subset"),
        ("self == oldSelf", "outside the CEL subset"),
        ("self.args == ['a']", "outside the CEL subset"),
        ("size(self.args) > 0", "outside the CEL subset"),
    ],
)
def test_ill_typed_or_unsupported_rules_are_refused(rule: str, error: str) -> None:
    assert error in (compile_error(rule) or "")


def test_the_root_sees_metadata_name_and_generate_name_only() -> None:
    root = {"type": "object", "properties": {"spec": {"type": "object"}}}
    assert compile_error("self.metadata.name.size() < 40", root, root=True) is None
    assert compile_error("self.kind == 'X' && self.apiVersion != ''", root, root=True) is None
    assert compile_error("has(self.metadata.generateName)", root, root=True) is None
    labels = compile_error("has(self.metadata.labels)", root, root=True)
    assert labels == "undefined field 'labels'"
    # Below the root, metadata is an ordinary field (here: none).
    assert compile_error("self.metadata.name == ''", root) == "undefined field 'metadata'"


_SCALARS = {
    "integer": (st.integers(-5, 5), "int"),
    "number": (st.floats(-5, 5, allow_nan=False), "double"),
    "string": (st.text("ab", max_size=3), "string"),
    "boolean": (st.booleans(), "bool"),
}


@given(
    left=st.sampled_from(sorted(_SCALARS)),
    right=st.sampled_from(sorted(_SCALARS)),
    op=st.sampled_from(["==", "!=", "<", ">="]),
    data=st.data(),
)
def test_a_rule_the_checker_accepts_never_fails_to_evaluate_on_a_valid_object(
    left: str, right: str, op: str, data: st.DataObject
) -> None:
    """The checker and the interpreter agree: accepted means no type error at run time."""
    schema = {
        "type": "object",
        "required": ["a", "b"],
        "properties": {"a": {"type": left}, "b": {"type": right}},
    }
    rule = f"self.a {op} self.b"
    error = compile_error(rule, schema)
    value = {"a": data.draw(_SCALARS[left][0]), "b": data.draw(_SCALARS[right][0])}
    if error is None:
        assert isinstance(S.evaluate(rule, S.to_cel(schema, value)), bool)
    else:
        with pytest.raises(S.CelError):
            S.evaluate(rule, S.to_cel(schema, value))
    same = left == right
    ordered = op in ("==", "!=") or left != "boolean"
    assert (error is None) is (same and ordered)


def test_the_fake_refuses_a_crd_whose_rule_does_not_compile() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    bad = copy.deepcopy(crd)
    spec = bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    index = len(spec["x-kubernetes-validations"])
    spec["x-kubernetes-validations"].append({"rule": "self.replicaCount > 0"})
    with FakeApiServer() as server:
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        code, status = request(server, "POST", path, bad)
        assert code == 422
        assert status["reason"] == "Invalid"
        assert (
            f"properties[spec].x-kubernetes-validations[{index}].rule: Invalid value: "
            "'self.replicaCount > 0': compilation failed: undefined field 'replicaCount'"
        ) in status["message"]
        assert request(server, "POST", path, crd)[0] == 201
