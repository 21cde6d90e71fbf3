"""The engine-flavor table: one flavor per engine name, chosen from the spec, and what each
flavor says is what the built objects carry. Shared modules never branch on the engine."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.names import ENGINES
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.capacity import pinned, rank_pinned
from dsv4_operator.flavors import FLAVORS, flavor_of
from dsv4_operator.manifests import WORKER_PORTS
from dsv4_operator.objects import DesiredState, build_desired_state

Body = dict[str, Any]
SAMPLES = {"dsv4": "tiny-pd.yaml", "sglang": "sglang-flash-pd.yaml"}
OPERATOR = Path(__file__).resolve().parents[1] / "dsv4_operator"


def _state(body: Body) -> DesiredState:
    spec = parse_spec(body)
    return build_desired_state(spec, parse_meta(body), plan_memory(spec))


def _pod_templates(state: DesiredState) -> list[Body]:
    kinds = ("StatefulSet", "Deployment")
    return [o["spec"]["template"] for o in state.objects if o["kind"] in kinds]


def test_every_engine_has_one_flavor_named_after_it() -> None:
    assert set(FLAVORS) == set(ENGINES)
    for name, make in FLAVORS.items():
        assert make().name == name
        assert make() is make()  # one flavor object per engine


@pytest.mark.parametrize("engine", sorted(SAMPLES))
def test_the_spec_chooses_its_flavor_and_the_objects_follow_it(
    engine: str, make_body: Callable[..., Body]
) -> None:
    body = make_body(SAMPLES[engine])
    spec = parse_spec(body)
    flavor = flavor_of(spec)
    assert flavor.name == spec.engine.name == engine
    state = _state(body)
    for template in _pod_templates(state):
        (tmp,) = (v for v in template["spec"]["volumes"] if v["name"] == "tmp")
        assert tmp["emptyDir"]["sizeLimit"] == flavor.tmp_limit
        main = template["spec"]["containers"][0]
        refused = flavor.args_refused(main["name"])
        assert refused is None or refused.startswith("not supported with engine")
    for template in _pod_templates(state)[:-1]:  # the workers (the router Deployment is last)
        labels = template["metadata"]["labels"]
        assert {k: labels[k] for k in flavor.worker_pod_labels(spec)} == dict(
            flavor.worker_pod_labels(spec)
        )
        assert (L.ENGINE_LABEL in labels) == bool(flavor.worker_pod_labels(spec))
    (policy,) = (
        o
        for o in state.objects
        if o["kind"] == "NetworkPolicy"
        and o["metadata"]["name"] == L.network_policy_name(parse_meta(body).name)
    )
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert WORKER_PORTS[flavor.observed_port] in ports
    assert (state.router_with_surge is not None) == flavor.router_lists_groups


@pytest.mark.parametrize("engine", sorted(SAMPLES))
def test_pinned_is_the_flavors_answer(engine: str, make_body: Callable[..., Body]) -> None:
    """dsv4: each rank its own plan; sglang: one figure set for every rank of a role."""
    spec = parse_spec(make_body(SAMPLES[engine]))
    plan = plan_memory(spec)
    for role in L.WORKER_ROLES:
        ranks = range(len(plan.role(role).ranks))
        got = [pinned(spec, plan, role, rank) for rank in ranks]
        assert got == [flavor_of(spec).pinned(plan, role, rank) for rank in ranks]
        if engine == "dsv4":
            assert got == [rank_pinned(plan, role, rank) for rank in ranks]
        else:
            assert len(set(got)) == 1


def _engine_branches(path: Path) -> list[str]:
    """`x.sglang` attribute reads and names containing `sglang` in conditions of `path`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.If, ast.IfExp)):
            for sub in ast.walk(node.test):
                name = sub.attr if isinstance(sub, ast.Attribute) else getattr(sub, "id", "")
                if "sglang" in name.lower():
                    found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr == "sglang":
            found.append(f"{path.name}:{node.lineno}")
    return sorted(set(found))


def test_shared_modules_never_branch_on_the_engine() -> None:
    """Only the flavors know which engine runs: no shared module tests for sglang."""
    shared = sorted(OPERATOR.glob("*.py"))
    assert len(shared) > 20
    assert [hit for path in shared for hit in _engine_branches(path)] == []
