"""The shared HTTP rules, pure: any byte string is either a JSON object or a 400 naming what is
wrong (never another exception); lone surrogates, deep nesting, huge or non-finite numbers are
400s naming the field; the connection bound never closes a busy connection and always makes
room when it can."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api.http_rules import (
    BodyError,
    OpenConnection,
    _check_naming,
    _passes,
    admit,
    check_content_length,
    connection_limit,
    error_document,
    one_line,
    parse_json_body,
)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(st.binary(max_size=200))
def test_any_bytes_are_an_object_or_a_400(raw: bytes) -> None:
    try:
        doc = parse_json_body(raw)
    except BodyError as exc:
        assert exc.status == 400
        json.dumps(exc.document())  # the answer itself always encodes
        one_line(str(exc)).encode("utf-8")
    else:
        assert isinstance(doc, dict)


@given(st.dictionaries(st.text(), JSON_VALUES, max_size=4))
def test_valid_objects_parse_back_unchanged(doc: dict[str, Any]) -> None:
    raw = json.dumps(doc).encode()
    try:
        assert parse_json_body(raw) == doc
    except BodyError as exc:  # only when the document holds a lone surrogate
        assert "surrogate" in exc.message
        with pytest.raises(UnicodeEncodeError):
            json.dumps(doc, ensure_ascii=False).encode("utf-8")


# Strings with lone surrogates and non-ASCII text; floats with NaN and infinities.
ANY_TEXT = st.text(st.sampled_from(["a", "\u00e9", "\u4e2d", "\ud800", "\udfff"]), max_size=3)
ANY_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=25,
)


@given(ANY_VALUES, st.integers(1, 5))
def test_the_quick_pass_agrees_with_the_walk_that_names_the_field(doc: object, depth: int) -> None:
    """check_values skips the naming walk when the quick pass says the document is clean: it
    must say so exactly when the walk would raise nothing."""
    try:
        _check_naming(doc, depth)
    except BodyError:
        assert not _passes(doc, depth)
    else:
        assert _passes(doc, depth) == isinstance(doc, dict | list)


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
        (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages[0].content", "surr"),
        (b'{"stop": ["ok", "\\udc00x"]}', "stop[1]", "surrogate"),
        (b'{"k\\ud800": 1}', "k\\ud800", "surrogate"),  # a key: its escape names it
        (b'{"temperature": 1e999}', "temperature", "finite"),
        (b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}", "a" + "[0]" * 63, "deeper"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", None, "4300 digits"),
        (b'{"temperature": NaN}', None, "NaN"),
        (b'{"temperature": -Infinity}', None, "Infinity"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested deeper"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, None, "nested deeper"),
        (b"\xff\xfe{}", None, "UTF-8"),
        (b"[1, 2]", None, "not an array"),
        (b"{not json", None, "not valid JSON"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(raw: bytes, param: str | None, says: str) -> None:
    with pytest.raises(BodyError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert says in caught.value.message


def test_content_length_over_the_limit_is_413() -> None:
    check_content_length(None, 10)
    check_content_length(10, 10)
    with pytest.raises(BodyError) as caught:
        check_content_length(10**12, 10)
    assert caught.value.status == 413 and caught.value.code == "request_too_large"


def test_the_error_document_is_openai_shaped() -> None:
    doc = error_document("no", "invalid_request_error", "prompt")
    assert doc == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "prompt", "code": None}
    }


def test_the_connection_limit_leaves_room_for_other_files() -> None:
    assert connection_limit(256, reserved_fds=64, fds_per_connection=1) == 192
    assert connection_limit(256, reserved_fds=64, fds_per_connection=2) == 96
    assert connection_limit(1 << 20, reserved_fds=64, fds_per_connection=1) == 4096
    assert connection_limit(10, reserved_fds=64, fds_per_connection=1) == 16


@given(
    st.lists(st.tuples(st.floats(0, 100), st.booleans()), max_size=30),
    st.integers(1, 30),
)
def test_admission_closes_only_incomplete_connections_oldest_first(
    conns: list[tuple[float, bool]], limit: int
) -> None:
    views = [OpenConnection(opened_s, busy) for opened_s, busy in conns]
    decision = admit(views, limit)
    idle = [i for i, v in enumerate(views) if not v.busy]
    if not decision.accept:
        assert len(views) + 1 - limit > len(idle)  # refused only when room cannot be made
        return
    assert not any(views[i].busy for i in decision.evict)
    assert len(views) - len(decision.evict) + 1 <= limit
    assert len(set(decision.evict)) == len(decision.evict)
    kept_idle = [views[i].opened_s for i in idle if i not in decision.evict]
    assert all(views[i].opened_s <= min(kept_idle, default=1e9) for i in decision.evict)
