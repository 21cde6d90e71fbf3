"""The fast path's request-head parser (`client_head`): what it serves itself, what it waits
for, and what it leaves to aiohttp; never a head aiohttp would refuse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_router.client_head import HAND_OFF, MAX_HEAD_BYTES, ClientHead, parse_head

BODY = b'{"prompt": "hi", "max_tokens": 3}'
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
)


def parsed(data: bytes, start: int = 0) -> ClientHead:
    head = parse_head(data, start)
    assert isinstance(head, ClientHead), head
    return head


def test_a_plain_completion_head() -> None:
    head = parsed(HEAD + BODY)
    assert (head.method, head.target, head.path, head.minor) == (
        "POST",
        "/v1/completions",
        "/v1/completions",
        1,
    )
    assert head.content_length == len(BODY) and head.keep_alive
    assert head.end == len(HEAD)
    assert head.headers[0] == (b"Host", b"router")  # as sent: case and order kept


def test_the_query_is_kept_in_the_target_but_not_the_path() -> None:
    head = parsed(b"POST /v1/completions?x=1 HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert (head.target, head.path) == ("/v1/completions?x=1", "/v1/completions")


@given(st.integers(min_value=0, max_value=len(HEAD) - 1))
def test_a_head_split_anywhere_waits_for_the_rest(cut: int) -> None:
    assert parse_head(HEAD[:cut]) is None
    assert parsed(HEAD[:cut] + HEAD[cut:]) == parsed(HEAD)


def test_pipelined_heads_are_read_one_after_another() -> None:
    data = (HEAD + BODY) * 3
    start = 0
    for _ in range(3):
        head = parsed(data, start)
        assert data[head.end : head.end + head.content_length] == BODY
        start = head.end + head.content_length
    assert start == len(data)


@given(
    st.sampled_from([b"content-length", b"CONTENT-LENGTH", b"Content-Length", b"cOnTeNt-LeNgTh"]),
    st.integers(min_value=0, max_value=10**12),
)
def test_header_names_are_matched_without_case(name: bytes, length: int) -> None:
    head = parsed(b"POST /v1/completions HTTP/1.1\r\n%s: %d\r\n\r\n" % (name, length))
    assert head.content_length == length
    assert head.headers == ((name, b"%d" % length),)


@pytest.mark.parametrize(
    ("line", "minor", "connection", "keep_alive"),
    [
        (b"HTTP/1.1", 1, b"", True),
        (b"HTTP/1.1", 1, b"Connection: close\r\n", False),
        (b"HTTP/1.1", 1, b"Connection: keep-alive, CLOSE\r\n", False),
        (b"HTTP/1.1", 1, b"Connection: keep-alive\r\n", True),
        (b"HTTP/1.0", 0, b"", False),
        (b"HTTP/1.0", 0, b"Connection: Keep-Alive\r\n", True),
        (b"HTTP/1.0", 0, b"Connection: close\r\n", False),
    ],
)
def test_keep_alive_follows_the_version_and_connection(
    line: bytes, minor: int, connection: bytes, keep_alive: bool
) -> None:
    head = parsed(b"POST /v1/completions %s\r\n%sContent-Length: 2\r\n\r\n{}" % (line, connection))
    assert (head.minor, head.keep_alive) == (minor, keep_alive)


def test_no_content_length_is_an_empty_body() -> None:
    assert parsed(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n").content_length == 0


def test_whitespace_around_a_value_is_not_part_of_it() -> None:
    head = parsed(b"POST /v1/completions HTTP/1.1\r\nX-A:  one two \t\r\nX-B:\r\n\r\n")
    assert head.headers == ((b"X-A", b"one two"), (b"X-B", b""))


UNUSUAL = {
    "chunked body": b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    "expect 100-continue": b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
    "upgrade": b"GET /v1/completions HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
    "connection upgrade": b"GET / HTTP/1.1\r\nConnection: Upgrade\r\n\r\n",
    "two content-lengths": (
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n"
    ),
    "two hosts": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "a signed length": b"POST /v1/completions HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
    "a length with spaces inside": b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n",
    "a negative length": b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    "a huge length": b"POST /v1/completions HTTP/1.1\r\nContent-Length: " + b"9" * 30 + b"\r\n\r\n",
    "bare LF line ends": b"POST /v1/completions HTTP/1.1\nHost: x\r\n\r\n",
    "a folded header": b"POST /v1/completions HTTP/1.1\r\nX-A: one\r\n two\r\n\r\n",
    "a space before the colon": b"POST /v1/completions HTTP/1.1\r\nHost : x\r\n\r\n",
    "a name with a space": b"POST /v1/completions HTTP/1.1\r\nBad Name: 1\r\n\r\n",
    "a NUL in a value": b"POST /v1/completions HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
    "non-ASCII in a value": b"POST /v1/completions HTTP/1.1\r\nX-A: \xc3\xa9\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "HTTP/0.9 style": b"GET /\r\n\r\n",
    "an absolute target": b"POST http://x/v1/completions HTTP/1.1\r\n\r\n",
    "a bad version": b"POST /v1/completions HTTP/9.x\r\n\r\n",
    "two spaces": b"POST  /v1/completions HTTP/1.1\r\n\r\n",
    "a lower-case method": b"post /v1/completions HTTP/1.1\r\n\r\n",
    "a space in the target": b"POST /v1/comp letions HTTP/1.1\r\n\r\n",
    "too many headers": b"POST / HTTP/1.1\r\n" + b"X: 1\r\n" * 129 + b"\r\n",
}


@pytest.mark.parametrize("case", list(UNUSUAL))
def test_unusual_heads_go_to_aiohttp(case: str) -> None:
    assert parse_head(UNUSUAL[case]) is HAND_OFF


def test_a_head_past_the_bound_goes_to_aiohttp_complete_or_not() -> None:
    line = b"X-Long: " + b"a" * MAX_HEAD_BYTES + b"\r\n"
    assert parse_head(b"POST /v1/completions HTTP/1.1\r\n" + line) is HAND_OFF
    assert parse_head(b"POST /v1/completions HTTP/1.1\r\n" + line + b"\r\n") is HAND_OFF
    assert parse_head(b"POST /v1/completions HTTP/1.1\r\n" + b"X: 1\r\n" * 10) is None


# Any bytes but line ends (those are the next test's); the parser must keep the visible ones.
VALUE_BYTES = st.binary(max_size=40).map(lambda v: v.replace(b"\r", b"").replace(b"\n", b""))
NAMES = st.from_regex(rb"\A[A-Za-z0-9!#$%&'*+.^_`|~-]{1,20}\Z")


@given(NAMES, VALUE_BYTES)
def test_any_header_is_served_as_sent_or_handed_off_never_misread(
    name: bytes, value: bytes
) -> None:
    data = b"POST /v1/completions HTTP/1.1\r\n%s: %s\r\nContent-Length: 2\r\n\r\n{}" % (
        name,
        value,
    )
    head = parse_head(data)
    assert head is not None
    clean = value.strip(b" \t")
    if head is HAND_OFF:  # a control or non-ASCII byte, or a second Content-Length
        assert name.lower() == b"content-length" or not all(
            0x20 <= b < 0x7F or b == 0x09 for b in clean
        )
        return
    assert isinstance(head, ClientHead)
    assert all(0x20 <= b < 0x7F or b == 0x09 for b in clean)
    assert name.lower() != b"content-length", "two Content-Lengths were served"
    assert (name, clean) in head.headers
    assert head.content_length == 2 and head.end == len(data) - 2


@given(VALUE_BYTES, st.sampled_from([b"\r", b"\n"]), st.integers(min_value=0, max_value=40))
def test_a_lone_cr_or_lf_in_a_head_is_never_served(value: bytes, end: bytes, at: int) -> None:
    value = value[:at] + end + value[at:]
    data = b"POST /v1/completions HTTP/1.1\r\nX-A: %s\r\nContent-Length: 0\r\n\r\n" % value
    assert parse_head(data) is HAND_OFF


@given(st.binary(max_size=300))
def test_random_bytes_never_raise(data: bytes) -> None:
    head = parse_head(data)
    assert head is None or head is HAND_OFF or isinstance(head, ClientHead)
    if isinstance(head, ClientHead):
        assert 0 < head.end <= len(data) and data[head.end - 4 : head.end] == b"\r\n\r\n"
