"""The download's progress document: round trip, refusals naming the field, percent, and a
termination message that always fits the kubelet's 4096 bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.fetch_status import (
    TERMINATION_LIMIT_BYTES,
    FetchStatus,
    fetch_status_to_dict,
    parse_fetch_status,
    termination_text,
)

S = FetchStatus(
    version=1, source="hf://a/b@main", phase="downloading", bytes_done=42, bytes_total=100
)


def test_a_document_round_trips() -> None:
    assert parse_fetch_status(json.loads(json.dumps(fetch_status_to_dict(S)))) == S


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"version": 2}, "fetch_status.version"),
        ({"phase": "paused"}, "fetch_status.phase"),
        ({"bytes_done": "42"}, "fetch_status.bytes_done"),
        ({"reason": "Tired"}, "fetch_status.reason"),
        ({"bytes_done": -1}, "fetch_status"),
    ],
)
def test_a_bad_document_names_its_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(DocumentError, match=field):
        parse_fetch_status({**fetch_status_to_dict(S), **change})


def test_percent_is_whole_and_100_only_when_complete() -> None:
    assert S.percent == 42
    full = FetchStatus(version=1, source="s", phase="checking", bytes_done=100, bytes_total=100)
    assert full.percent == 99
    assert FetchStatus(version=1, source="s", phase="complete").percent == 100
    assert FetchStatus(version=1, source="s", phase="resolving").percent == 0


@given(st.text(max_size=9000))
def test_a_termination_message_fits_and_parses(message: str) -> None:
    status = FetchStatus(
        version=1, source="hf://a/b", phase="failed", reason="NotFound", message=message
    )
    text = termination_text(status)
    assert len(text.encode()) <= TERMINATION_LIMIT_BYTES
    parsed = parse_fetch_status(json.loads(text))
    assert parsed.reason == "NotFound"
    if (
        len(json.dumps(fetch_status_to_dict(status), separators=(",", ":")).encode())
        <= TERMINATION_LIMIT_BYTES
    ):
        assert parsed == status
    else:
        assert (parsed.message or "").endswith("…")
