"""The request id rules (`dsv4_common.api.request_id`): what an entry point takes from the
client, what it makes, and the ids of retries and choices."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api.request_id import (
    MAX_FORWARDED_ID_CHARS,
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_HEADER,
    InvalidRequestId,
    attempt_id,
    choice_id,
    request_id_of,
)

ALLOWED = string.ascii_letters + string.digits + "._:-"
VALID_IDS = st.text(alphabet=ALLOWED, min_size=1, max_size=MAX_REQUEST_ID_CHARS)


def test_no_header_gets_a_new_id_each_time() -> None:
    ids = {request_id_of(None) for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in ids)


@given(VALID_IDS)
def test_a_valid_client_id_is_kept_as_it_came(rid: str) -> None:
    assert request_id_of(rid) == rid


@given(VALID_IDS, st.sampled_from(sorted(set(map(chr, range(32, 127))) - set(ALLOWED))))
def test_any_other_character_is_refused_naming_the_header(rid: str, bad: str) -> None:
    with pytest.raises(InvalidRequestId, match=REQUEST_ID_HEADER):
        request_id_of(rid[: MAX_REQUEST_ID_CHARS - 1] + bad)


@pytest.mark.parametrize("rid", ["", "a" * (MAX_REQUEST_ID_CHARS + 1), "é", "a b", "x/0", "\n"])
def test_empty_long_or_odd_ids_are_refused(rid: str) -> None:
    with pytest.raises(InvalidRequestId, match=f"1 to {MAX_REQUEST_ID_CHARS} characters"):
        request_id_of(rid)


def test_a_worker_takes_room_for_the_routers_attempt_suffix() -> None:
    longest = "a" * MAX_REQUEST_ID_CHARS
    retried = attempt_id(longest, 99)
    assert len(retried) <= MAX_FORWARDED_ID_CHARS
    assert request_id_of(retried, MAX_FORWARDED_ID_CHARS) == retried
    with pytest.raises(InvalidRequestId):
        request_id_of(retried)  # a client may not send it to the router


@given(VALID_IDS, st.integers(0, 99), st.integers(0, 99))
def test_attempts_have_distinct_ids_that_start_with_the_request_id(
    rid: str, a: int, b: int
) -> None:
    assert attempt_id(rid, 0) == rid
    assert attempt_id(rid, a).startswith(rid)
    assert (attempt_id(rid, a) == attempt_id(rid, b)) == (a == b)


@given(VALID_IDS, st.integers(2, 16))
def test_choices_have_distinct_ids_that_no_client_can_send(rid: str, n: int) -> None:
    assert choice_id(rid, 0, 1) == rid
    ids = [choice_id(rid, i, n) for i in range(n)]
    assert len(set(ids)) == n
    for cid in ids:
        assert cid.startswith(rid + "/")
        with pytest.raises(InvalidRequestId):
            request_id_of(cid, MAX_FORWARDED_ID_CHARS + 8)
