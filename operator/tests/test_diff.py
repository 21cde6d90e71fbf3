"""`holds`: what the operator planned is recognized in the form a real API server stores it
(#23 item 4), so a converged deployment is not re-applied on every reconcile; a real change is
still seen."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_operator.diff import holds
from dsv4_operator.quantities import quantity, same_quantity

POD: dict[str, Any] = {
    "spec": {
        "containers": [
            {
                "name": "worker",
                "image": "w:1",
                "args": ["serve", "--role", "decode"],
                "resources": {
                    "requests": {"cpu": 0.5, "memory": "1024Mi"},
                    "limits": {"memory": "2048Mi", "nvidia.com/gpu": 1},
                },
                "env": [{"name": "A", "value": "1"}],
                "ports": [{"containerPort": 8080, "name": "http"}],
                "volumeMounts": [{"name": "config", "mountPath": "/config"}],
            }
        ],
        "volumes": [{"name": "config", "emptyDir": {"sizeLimit": "0.5Gi"}}],
    }
}


def _as_the_server_stores_it(planned: dict[str, Any]) -> dict[str, Any]:
    """Quantities canonicalized, defaults added, and items other managers added."""
    live = copy.deepcopy(planned)
    (c,) = live["spec"]["containers"]
    c["resources"] = {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "2Gi", "nvidia.com/gpu": "1"},
    }
    c["ports"][0]["protocol"] = "TCP"  # defaulted
    c["terminationMessagePath"] = "/dev/termination-log"
    c["env"].insert(0, {"name": "INJECTED", "value": "x"})  # a mutating webhook's
    c["volumeMounts"].append({"name": "token", "mountPath": "/var/run/secrets"})
    live["spec"]["containers"].append({"name": "sidecar", "image": "mesh:1"})
    live["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "512Mi"
    live["spec"]["volumes"].append({"name": "token", "projected": {}})
    return live


def test_a_converged_object_as_the_server_stores_it_holds() -> None:
    assert holds(_as_the_server_stores_it(POD), POD)


@pytest.mark.parametrize(
    "edit",
    [
        lambda c, v: c["resources"]["requests"].update(cpu="501m"),
        lambda c, v: c["resources"]["limits"].update(memory="2Gi1"),
        lambda c, v: c.update(args=["serve", "--role", "prefill"]),
        lambda c, v: c.update(args=["serve", "--role"]),
        lambda c, v: c["env"].pop(),  # our item gone
        lambda c, v: c["env"][-1].update(value="2"),
        lambda c, v: c["ports"][0].update(containerPort=8081),
        lambda c, v: v[0]["emptyDir"].update(sizeLimit="513Mi"),
    ],
)
def test_a_real_difference_is_still_seen(edit: Any) -> None:
    live = _as_the_server_stores_it(POD)
    edit(live["spec"]["containers"][0], live["spec"]["volumes"])
    assert not holds(live, POD)


def test_a_missing_container_is_a_difference() -> None:
    live = _as_the_server_stores_it(POD)
    live["spec"]["containers"] = [c for c in live["spec"]["containers"] if c["name"] != "worker"]
    assert not holds(live, POD)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("500m", 0.5, True),
        ("1Gi", "1024Mi", True),
        ("1k", "1000", True),
        ("1e3", 1000, True),
        ("1.5", "1500m", True),
        ("1Ki", "1000", False),
        ("1M", "1Mi", False),
        ("abc", "abc", False),  # not a quantity: never equal as one
        (True, 1, False),
    ],
)
def test_quantities_compare_by_value(a: object, b: object, same: bool) -> None:
    assert same_quantity(a, b) is same


FACTORS = {"m": "0.001", "": "1", "k": "1000", "Ki": "1024", "Mi": "1048576", "Gi": "1073741824"}


@given(st.integers(0, 10**6), st.sampled_from(sorted(FACTORS)))
def test_a_suffix_scales_the_number(number: int, suffix: str) -> None:
    assert quantity(f"{number}{suffix}") == number * Decimal(FACTORS[suffix])
    if suffix == "m":  # the canonical milli form equals its decimal form
        assert same_quantity(f"{number}m", f"{number // 1000}.{number % 1000:03d}")
