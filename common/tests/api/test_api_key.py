"""API keys (`dsv4_common.api.api_key`): which paths want the key, the Bearer check, how a key
is read and refused, and the start-up warning of a server exposed without one."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api.api_key import (
    MISSING_MESSAGE,
    NO_API_KEY,
    OPEN_PATHS,
    STATUS_PATHS,
    UNAUTHORIZED_CODE,
    WRONG_MESSAGE,
    ApiKeyError,
    ApiKeyRule,
    bearer_token,
    exposed_without_key,
    parse_api_key,
    resolve_api_key,
    unauthorized_document,
)

KEY = b"sk-test-0123456789"
RULE = ApiKeyRule(KEY)
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/x", "/nope", "/"]


@pytest.mark.parametrize("status_port", [False, True])
@pytest.mark.parametrize("open_status", [False, True])
def test_which_paths_want_the_key(status_port: bool, open_status: bool) -> None:
    rule = ApiKeyRule(KEY, open_status=open_status)
    for path in OPEN_PATHS:
        assert not rule.needs_key(path, status_port=status_port)
    for path in STATUS_PATHS:
        assert rule.needs_key(path, status_port=status_port) is not (status_port and open_status)
    for path in PATHS:  # /v1/* and anything unknown: always
        assert rule.needs_key(path, status_port=status_port)


def test_without_a_key_every_path_is_open_and_any_header_passes() -> None:
    for path in [*OPEN_PATHS, *STATUS_PATHS, *PATHS]:
        assert not NO_API_KEY.needs_key(path, status_port=False)
    assert NO_API_KEY.allows(None) and NO_API_KEY.allows(b"Bearer whatever")
    assert NO_API_KEY.credential() is None


@pytest.mark.parametrize(
    "header",
    [
        b"Bearer sk-test-0123456789",
        b"bearer sk-test-0123456789",
        b"BEARER  sk-test-0123456789 ",
        "Bearer sk-test-0123456789",  # aiohttp's headers are str
    ],
)
def test_the_key_in_any_bearer_spelling_passes(header: bytes | str) -> None:
    assert RULE.allows(header)


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"",
        b"Bearer",
        b"Bearer ",
        b"sk-test-0123456789",  # no scheme
        b"Basic sk-test-0123456789",
        b"Bearer sk-test-012345678",  # a prefix
        b"Bearer sk-test-01234567890",  # one more
        b"Bearer SK-TEST-0123456789",  # the token is case-sensitive
        b"Bearer sk-test-0123456789 extra",
        b"Bearer\tsk-test-0123456789",  # RFC 7235: one or more spaces after the scheme
    ],
)
def test_anything_but_the_key_is_refused(header: bytes | None) -> None:
    assert not RULE.allows(header)


@given(st.binary(max_size=64))
def test_no_other_token_passes(token: bytes) -> None:
    header = b"Bearer " + token
    assert RULE.allows(header) is (token.strip(b" \t") == KEY)


def test_the_router_sends_its_own_key() -> None:
    assert RULE.credential() == "Bearer sk-test-0123456789"
    assert RULE.allows(RULE.credential())


def test_the_401_body_is_openai_s_and_never_echoes_the_key() -> None:
    missing = unauthorized_document(None)
    assert missing == {
        "error": {
            "message": MISSING_MESSAGE,
            "type": "invalid_request_error",
            "param": None,
            "code": UNAUTHORIZED_CODE,
        }
    }
    wrong = unauthorized_document(b"Bearer guessed-secret")
    assert wrong["error"]["message"] == WRONG_MESSAGE
    assert "guessed-secret" not in str(wrong)
    assert bearer_token(b"Basic abc") is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("  \n", "empty"),
        ("two words", "printable ASCII"),
        ("tab\tinside", "printable ASCII"),
        ("naïve", "printable ASCII"),
        ("x" * 4097, "longer than 4096"),
    ],
)
def test_an_unusable_key_is_refused_naming_where_it_came_from(text: str, why: str) -> None:
    with pytest.raises(ApiKeyError, match=rf"^--api-key: .*{why}"):
        parse_api_key(text, "--api-key")


def test_a_key_file_s_last_newline_is_not_part_of_the_key(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("sk-from-file\n")
    assert resolve_api_key(None, str(path)) == b"sk-from-file"
    assert resolve_api_key(None, None, str(path)) == b"sk-from-file"
    assert resolve_api_key("sk-flag", None, str(path)) == b"sk-flag"  # the flag wins
    assert resolve_api_key(None, None, None) is None


def test_key_flags_and_files_are_refused_naming_the_flag_or_field(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match=r"^--api-key: .*not both"):
        resolve_api_key("a", str(tmp_path / "key"))
    with pytest.raises(ApiKeyError, match=r"^--api-key-file: cannot read"):
        resolve_api_key(None, str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ApiKeyError, match=r"^rank config api_key_file .*empty"):
        resolve_api_key(None, None, str(empty), config_field="rank config api_key_file")


@pytest.mark.parametrize(
    ("host", "warned"),
    [
        ("127.0.0.1", False),
        ("127.9.9.9", False),
        ("::1", False),
        ("[::1]", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("", True),
        ("10.1.2.3", True),
        ("worker.example", True),
    ],
)
def test_a_server_beyond_loopback_without_a_key_says_so(host: str, warned: bool) -> None:
    warning = exposed_without_key(host, NO_API_KEY)
    assert (warning is not None) is warned
    if warning is not None:
        assert "without an API key" in warning and "--api-key-file" in warning
    assert exposed_without_key(host, RULE) is None
