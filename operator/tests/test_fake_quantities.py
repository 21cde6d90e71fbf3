"""The fake API server stores resource quantities in the real server's canonical form
(support/quantity_canon.py, restating apimachinery pkg/api/resource), and the operator still
recognizes what it planned in that form (diff.holds). The known pairs are the upstream
quantity_test.go expectations (TestQuantityParseEmit, TestQuantityString, TestQuantityParse)."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support import quantity_canon as Q
from support.fake_apiserver import FakeApiServer
from support.fake_http import APPLY, call, ok

from dsv4_operator.diff import holds
from dsv4_operator.quantities import MILLI, quantity, same_quantity

# (written, stored): the canonical form is kept as written, anything else rewritten.
CANONICAL = [
    ("0.5", "500m"), ("1024Mi", "1Gi"), ("1000m", "1"), ("2Gi", "2Gi"), ("1e3", "1e3"),
    ("1000", "1k"), ("100m", "100m"), ("1.5Gi", "1536Mi"), ("307200Ki", "300Mi"),
    ("1025024Mi", "1001Gi"), ("1024Gi", "1Ti"), ("5000m", "5"), ("1000M", "1G"),
    ("0.001T", "1G"), ("1000u", "1m"), ("1.08", "1080m"), ("1080000000n", "1080m"),
    (".001e12", "1e9"), ("0.001e0", "1e-3"), ("1000e-12", "1e-9"), ("1000e0", "1e3"),
    ("00", "0"), ("-0", "0"), (".001Ki", "1024m"), (".000001Ki", "1024u"),
    (".000000001Ki", "1024n"), (".000000000001Ki", "2n"), ("3.001n", "4n"),
    ("0.0000000001", "1n"), ("1023Ki", "1023Ki"), ("0.1Ki", "102400m"), ("1025", "1025"),
    ("300M", "300M"), ("1234567M", "1234567M"), ("80e-3", "80e-3"), ("12E", "12E"),
    ("9Ei", "9223372036854775807"), (" 2Gi ", "2Gi"),
]  # fmt: skip
INVALID = ["", "1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01e-", "1 Gi", "1e"]


@pytest.mark.parametrize(("written", "stored"), CANONICAL)
def test_quantities_are_stored_as_the_real_server_writes_them(written: str, stored: str) -> None:
    assert Q.canonical_quantity(written) == stored
    if stored != "0":
        assert Q.canonical_quantity("-" + written.strip()) == "-" + stored
    assert str(Q.parse_quantity(stored)) == stored


def test_text_already_canonical_looking_is_kept_as_written() -> None:
    """ParseQuantity's int64 fast path keeps the input text when it looks canonical: binary
    with a number not a multiple of 8, decimal with no trailing 000 and no leading 0 digit
    (even `+1` and `01`, as the real server writes them back)."""
    kept = ["2Gi", "1023Ki", "100m", "1e3", "12e6", "+1", "01", "1."]
    rewritten = ["1024Mi", "1536Mi", "1000m", "0.5", "1000", "1000e0"]
    assert [str(Q.parse_quantity(t)) for t in kept] == kept
    assert all(Q.parse_quantity(t).text is None for t in rewritten)


@pytest.mark.parametrize("written", INVALID)
def test_what_is_not_a_quantity_is_refused(written: str) -> None:
    with pytest.raises(Q.QuantityError):
        Q.parse_quantity(written)


def test_json_numbers_are_read_from_their_text() -> None:
    assert [Q.canonical_quantity(v) for v in (1, 0.5, 1e-05, 2048)] == [
        "1",
        "500m",
        "10e-6",
        "2048",
    ]
    bad_values: list[object] = [True, None, [], float("nan")]
    for bad in bad_values:
        with pytest.raises(Q.QuantityError):
            Q.from_json(bad)


def test_requests_and_limits_are_rounded_up_to_milli() -> None:
    """SetDefaults_ResourceList: RoundUp(Milli); coarser values keep their text."""
    cases = {"100u": "1m", "1500u": "2m", "1.0001": "1001m", "0.5": "500m", "+1": "+1"}
    for written, stored in cases.items():
        assert str(Q.round_up_milli(Q.parse_quantity(written))) == stored


_SUFFIXES = ["", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
QUANTITIES = st.builds(
    lambda sign, whole, frac, suffix: f"{sign}{whole}{frac}{suffix}",
    st.sampled_from(["", "+", "-"]),
    st.text("0123456789", min_size=1, max_size=7),
    st.one_of(st.just(""), st.text("0123456789", max_size=10).map(lambda d: "." + d)),
    st.one_of(
        st.sampled_from(_SUFFIXES),
        st.builds(lambda e, n: f"{e}{n}", st.sampled_from(["e", "E"]), st.integers(-12, 12)),
    ),
)


def _value(text: str) -> Fraction:
    return Q.parse_quantity(text).value


@settings(max_examples=400, deadline=None)
@given(QUANTITIES)
def test_canonical_forms_are_stable_and_keep_the_value(written: str) -> None:
    q = Q.parse_quantity(written)
    stored = str(q)
    assume(q.fmt != "DecimalSI" or abs(q.value) < 10**21)  # past E the server drops the suffix
    assert Q.canonical_quantity(stored) == stored  # canonical(canonical(q)) == canonical(q)
    assert _value(stored) == q.value  # exact, after the nano rounding of reading
    # nano rounding: up, by less than 1n
    exact = quantity(written)
    if exact is not None and abs(exact) <= Q.MAX_BINARY:  # binary SI is capped there
        assert 0 <= abs(q.value) - abs(Fraction(exact)) < Fraction(1, 10**9)


@settings(max_examples=400, deadline=None)
@given(QUANTITIES)
def test_the_operator_reads_the_stored_form_as_the_value_it_planned(written: str) -> None:
    """Two independent parsers agree: what the operator planned and what the server stored
    compare equal in diff.holds, for requests and limits (rounded up to milli) too."""
    planned = quantity(written)
    assume(planned is not None and 0 <= planned <= Q.MAX_BINARY)
    stored = Q.round_up_milli(Q.parse_quantity(written))
    assume(stored.fmt != "DecimalSI" or stored.value < 10**21)
    live = {"requests": {"cpu": str(stored)}}
    assert holds(live, {"requests": {"cpu": written}})


def test_the_operator_rounds_as_the_server_stores() -> None:
    """What the property above found: a planned request finer than milli (or any quantity
    finer than nano) was never equal to its stored form, so it was re-applied forever."""
    assert holds({"limits": {"cpu": "1m"}}, {"limits": {"cpu": "100u"}})
    assert holds({"emptyDir": {"sizeLimit": "1n"}}, {"emptyDir": {"sizeLimit": "0.0000000001"}})
    assert not holds({"limits": {"cpu": "1m"}}, {"limits": {"cpu": "2m"}})
    assert not same_quantity("100u", "1m") and same_quantity("100u", "1m", MILLI)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as srv:
        yield srv


def _pod_template(resources: dict[str, Any], size: str) -> dict[str, Any]:
    volume = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}
    return {
        "metadata": {"labels": {"app": "w"}},
        "spec": {
            "containers": [{"name": "w", "image": "w:1", "resources": resources}],
            "volumes": [volume],
        },
    }


def test_the_server_canonicalizes_the_quantities_of_built_in_kinds(server: FakeApiServer) -> None:
    resources = {"requests": {"cpu": 0.5, "memory": "1024Mi"}, "limits": {"cpu": "100u"}}
    sts: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "w"},
        "spec": {
            "selector": {"matchLabels": {"app": "w"}},
            "template": _pod_template(resources, "1000Mi"),
        },
    }
    url = "/apis/apps/v1/namespaces/default/statefulsets/w?fieldManager=t"
    stored = ok(call(server, "PATCH", url, sts, APPLY))["spec"]["template"]["spec"]
    assert stored["containers"][0]["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "1m"},
    }
    assert stored["volumes"][0]["emptyDir"]["sizeLimit"] == "1000Mi"
    bad = {**sts, "spec": {**sts["spec"], "template": _pod_template({}, "lots")}}
    code, status = call(server, "PATCH", url, bad, APPLY)
    assert (code, status["reason"]) == (400, "BadRequest")
    assert status["message"].startswith('StatefulSet in version "v1" cannot be handled as a')
    assert "quantities must match the regular expression" in status["message"]
