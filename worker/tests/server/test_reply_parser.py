"""The reply parser: whatever the token boundaries, the same reasoning, content and tool calls,
and no part of a think or DSML tag in reasoning or content. Sample replies written in the
release's format, then hypothesis over every split of them and of adversarial texts (tags
inside JSON strings and parameter values, unterminated calls, nested quotes, text around
calls)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.server.dsml import (
    BLOCK_CLOSE,
    BLOCK_LEAD,
    BLOCK_OPEN,
    INVOKE_CLOSE,
    MARK,
    PARAM_CLOSE,
    THINK_END,
    THINK_START,
    invoke_open,
    param_open,
    render_block,
)
from dsv4_worker.server.reply_parser import ParsedCall, ReplyParser

TAGS = (THINK_START, THINK_END, MARK)
Result = tuple[str, str, list[ParsedCall]]


def parse(pieces: list[str], *, reasoning: bool) -> Result:
    parser = ReplyParser(reasoning=reasoning)
    r, c, calls = "", "", []
    for piece in pieces:
        out = parser.push(piece)
        r, c, calls = r + out.reasoning, c + out.content, calls + out.calls
    out = parser.finish()
    return r + out.reasoning, c + out.content, calls + out.calls


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(max(p, 0), len(text)) for p in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def no_tag_in(result: Result) -> None:
    reasoning, content, _ = result
    for tag in TAGS:
        assert tag not in reasoning and tag not in content, (tag, result)


def calls_of(result: Result) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in result[2]]


# ---- replies in the release's format, with what they must parse to ---------------------------

WEATHER = {"location": "Beijing", "unit": "celsius"}
NESTED = {"query": 'say "hi" to <b>them</b>', "filters": {"tags": ["a", "b"], "n": 2}, "ok": True}
SAMPLES: list[tuple[str, bool, str, str, list[tuple[str, Any]]]] = [
    # (id, opens with reasoning, reply text, reasoning, content) + the calls
    ("plain", False, "The capital of France is Paris.", "", "The capital of France is Paris.", []),
    (
        "thinking",
        True,
        "The user asks about France.\nIt is Paris.</think>The capital is **Paris**.",
        "The user asks about France.\nIt is Paris.",
        "The capital is **Paris**.",
        [],
    ),
    (
        "thinking-then-call",
        True,
        "I should use the get_weather tool.</think>"
        + BLOCK_LEAD
        + render_block([("get_weather", WEATHER)]),
        "I should use the get_weather tool.",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "content-then-calls",
        False,
        "Let me look both up."
        + BLOCK_LEAD
        + render_block([("search", NESTED), ("get_weather", {"location": "東京"})]),
        "",
        "Let me look both up.",
        [("search", NESTED), ("get_weather", {"location": "東京"})],
    ),
    (
        "call-inside-reasoning",  # ends the reasoning: a call, never reasoning
        True,
        "Need data." + BLOCK_LEAD + render_block([("search", {"query": "x"})]) + "Done.",
        "Need data.",
        "Done.",
        [("search", {"query": "x"})],
    ),
    (
        "tags-inside-values",
        False,
        BLOCK_LEAD
        + render_block(
            [("echo", {"text": f"a {THINK_END} b {BLOCK_OPEN} c", "json": {"s": PARAM_CLOSE}})]
        ),
        "",
        "",
        [("echo", {"text": f"a {THINK_END} b {BLOCK_OPEN} c", "json": {"s": PARAM_CLOSE}})],
    ),
    (
        "no-parameters",
        False,
        BLOCK_LEAD + render_block([("now", {})]),
        "",
        "",
        [("now", {})],
    ),
    (
        "json-body-invoke",  # SGLang's second form: the invoke's body is the JSON object
        False,
        f'{BLOCK_OPEN}\n{invoke_open("f")}\n{{"a": [1, 2]}}\n{INVOKE_CLOSE}\n{BLOCK_CLOSE}',
        "",
        "",
        [("f", {"a": [1, 2]})],
    ),
    (
        "not-json-value-becomes-a-string",
        False,
        f"{BLOCK_OPEN}\n{invoke_open('f')}\n{param_open('n', False)}twelve{PARAM_CLOSE}\n"
        f"{INVOKE_CLOSE}\n{BLOCK_CLOSE}",
        "",
        "",
        [("f", {"n": "twelve"})],
    ),
    (
        "unterminated-call-is-dropped",
        False,
        "Calling." + BLOCK_LEAD + f"{BLOCK_OPEN}\n{invoke_open('f')}\n{param_open('a', True)}x",
        "",
        "Calling.",
        [],
    ),
    (
        "stray-tags-are-dropped",
        False,
        f"a {THINK_START}b{THINK_END} c </{MARK}invoke> d {MARK}",
        "b",
        "a  cd",  # whitespace before a DSML tag goes with it; a block skips what follows
        [],
    ),
    ("cut-mid-tag", False, "Hello <｜DSML｜too", "", "Hello", []),
    ("lone-angle-at-end-is-text", False, "1 <", "", "1 <", []),
]


@pytest.mark.parametrize(
    ("reasoning", "text", "want_reasoning", "want_content", "want_calls"),
    [s[1:] for s in SAMPLES],
    ids=[s[0] for s in SAMPLES],
)
def test_samples_parse_the_same_at_every_split(
    reasoning: bool, text: str, want_reasoning: str, want_content: str, want_calls: list[Any]
) -> None:
    whole = parse([text], reasoning=reasoning)
    assert whole[0] == want_reasoning and whole[1] == want_content
    assert calls_of(whole) == want_calls
    no_tag_in(whole)
    for i in range(len(text) + 1):  # every split in two, and one character at a time
        assert parse([text[:i], text[i:]], reasoning=reasoning) == whole
    assert parse(list(text), reasoning=reasoning) == whole


@settings(max_examples=150, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_samples_under_random_splits(sample: Any, cuts: list[int]) -> None:
    _, reasoning, text, *_ = sample
    assert parse(split_at(text, cuts), reasoning=reasoning) == parse([text], reasoning=reasoning)


# ---- generated replies: what goes in comes out ------------------------------------------------

# Text without tags (and not ending in a tag's beginning, nor in whitespace before a block).
plain = (
    st.lists(st.sampled_from([*"ab xyz\n\"'{}[]:,<>/\\|=日", "｜", "DSML", "think"]), max_size=20)
    .map("".join)
    .filter(lambda t: not any(tag in t for tag in TAGS))
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | plain,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(plain, inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(
    st.text(alphabet="abc_", min_size=1, max_size=6),
    json_value | st.text(max_size=20),  # string values may hold tags: they are data
    max_size=4,
)
call = st.tuples(st.sampled_from(["f", "get_weather", "x-y"]), arguments)


def _clean_end(text: str) -> bool:
    return not text[-1:].isspace() and not any(
        tag.startswith(text[-n:])
        for tag in ("<think>", "</think>", "<｜DSML｜", "｜DSML｜")
        for n in range(1, 9)
    )


@settings(max_examples=300, deadline=None)
@given(
    reasoning=st.one_of(st.none(), plain),
    content=plain,
    calls=st.lists(call, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=16),
)
def test_generated_replies_round_trip_at_any_split(
    reasoning: str | None, content: str, calls: list[Any], cuts: list[int]
) -> None:
    text = (reasoning + THINK_END if reasoning is not None else "") + content
    if calls:
        if content and not _clean_end(content):
            content += "."
            text += "."
        text += BLOCK_LEAD + render_block(calls)
    elif content and not _clean_end(content):
        return  # a content tail that is a tag's beginning: covered by the samples
    result = parse(split_at(text, cuts), reasoning=reasoning is not None)
    assert result[0] == (reasoning or "")
    assert result[1] == content
    assert calls_of(result) == [(n, json.loads(json.dumps(a))) for n, a in calls]
    no_tag_in(result)


# ---- adversarial texts: tags anywhere, any split ----------------------------------------------

FRAGMENTS = [
    THINK_START,
    THINK_END,
    BLOCK_OPEN,
    BLOCK_CLOSE,
    invoke_open("f"),
    invoke_open('a"b'),
    INVOKE_CLOSE,
    param_open("k", True),
    param_open("j", False),
    PARAM_CLOSE,
    f"<{MARK}parameter name=",
    f"<{MARK}bogus x=y>",
    '"',
    '\\"',
    "{",
    '{"s": "',
    "}",
    "\n",
    "\n\n",
    " ",
    "text",
    "日本",
    "<",
    "</",
    ">",
    "1",
]


@settings(max_examples=500, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=20),
    reasoning=st.booleans(),
)
def test_adversarial_texts_are_split_invariant_and_leak_no_whole_tag(
    parts: list[str], cuts: list[int], reasoning: bool
) -> None:
    text = "".join(parts)
    whole = parse([text], reasoning=reasoning)
    assert parse(split_at(text, cuts), reasoning=reasoning) == whole
    assert parse(list(text), reasoning=reasoning) == whole
    for c in whole[2]:
        assert isinstance(json.loads(c.arguments), dict)  # arguments always a JSON object
    # No fragment but a whole tag spells a tag's name, so any tag in the output would be
    # one the input had: none may get through.
    no_tag_in(whole)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_text_is_split_invariant(text: str, cuts: list[int]) -> None:
    for reasoning in (False, True):
        assert parse(split_at(text, cuts), reasoning=reasoning) == parse(
            [text], reasoning=reasoning
        )
