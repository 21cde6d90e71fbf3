"""`spec.model.source` and `dsv4 serve --model`: hf://, pvc:// and local paths parse to what they
say; every refusal says which rule it breaks; the CRD's pattern accepts what the parser accepts
(the parser only adds rules a pattern cannot state)."""

from __future__ import annotations

import contextlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api.model_source import (
    SOURCE_PATTERN,
    HfSource,
    LocalSource,
    PvcSource,
    SourceError,
    parse_model_source,
    repo_folder_name,
    snapshot_path,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("hf://deepseek-ai/DeepSeek-V4-Flash", HfSource("deepseek-ai/DeepSeek-V4-Flash", "main")),
        ("hf://deepseek-ai/DeepSeek-V4-Flash@main", HfSource("deepseek-ai/DeepSeek-V4-Flash")),
        ("hf://org/m_1.5@v1.0", HfSource("org/m_1.5", "v1.0")),
        ("hf://org/m@refs/pr/12", HfSource("org/m", "refs/pr/12")),
        (f"hf://org/m@{COMMIT}", HfSource("org/m", COMMIT)),
        ("pvc://models", PvcSource("models", "")),
        ("pvc://models/deepseek/v4-flash", PvcSource("models", "deepseek/v4-flash")),
        ("/srv/models/tiny", LocalSource("/srv/models/tiny")),
    ],
)
def test_a_source_parses_to_what_it_says(text: str, parsed: object) -> None:
    assert parse_model_source(text) == parsed
    assert re.match(SOURCE_PATTERN, text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("hf://org", "not hf://ORG/NAME"),
        ("hf://org/name/extra", "not hf://ORG/NAME"),
        ("hf://-org/name", "not hf://ORG/NAME"),
        ("hf://org/na--me", "'--'"),
        ("hf://org/name.git", "'.git'"),
        ("hf://org/name@", "not hf://ORG/NAME"),
        ("hf://org/name@a..b", "no '..'"),
        ("hf://org/" + "n" * 100, "at most 96"),
        ("pvc://Models", "not pvc://CLAIM"),
        ("pvc://models/../etc", "'.' or '..'"),
        ("pvc://models/a//b", "not pvc://CLAIM"),
        ("s3://bucket/key", "unknown scheme s3://"),
        ("relative/dir", "must be absolute"),
        ("", "must not be empty"),
    ],
)
def test_a_bad_source_says_which_rule_it_breaks(text: str, why: str) -> None:
    with pytest.raises(SourceError, match=re.escape(why)):
        parse_model_source(text)


def test_the_cli_takes_a_relative_path() -> None:
    assert parse_model_source("models/tiny", relative_ok=True) == LocalSource("models/tiny")


PART = st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,20}[A-Za-z0-9_])?", fullmatch=True)


@given(
    PART,
    PART,
    st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,30}", fullmatch=True)),
)
def test_what_the_parser_accepts_the_crd_pattern_accepts(
    org: str, name: str, rev: str | None
) -> None:
    text = f"hf://{org}/{name}" + (f"@{rev}" if rev is not None else "")
    try:
        source = parse_model_source(text)
    except SourceError:
        return  # a rule the pattern cannot state (or a malformed revision)
    assert re.match(SOURCE_PATTERN, text), text
    assert isinstance(source, HfSource) and source.repo_id == f"{org}/{name}"
    assert parse_model_source(source.uri) == source  # the URI round-trips


@given(st.text(max_size=60))
def test_any_text_parses_or_is_refused_with_a_source_error(text: str) -> None:
    """No other exception type escapes, whatever the text."""
    with contextlib.suppress(SourceError):
        parse_model_source(text)


def test_the_cache_folder_is_huggingface_hubs() -> None:
    from huggingface_hub.file_download import repo_folder_name as hf_folder

    assert repo_folder_name("deepseek-ai/DeepSeek-V4") == hf_folder(
        repo_id="deepseek-ai/DeepSeek-V4", repo_type="model"
    )
    assert snapshot_path("/cache/", "a/b", COMMIT) == f"/cache/models--a--b/snapshots/{COMMIT}"
