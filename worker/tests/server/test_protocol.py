"""Request parsing: each validation rule rejects with its field named; good bodies give the
expected request, defaults included."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.api_options import ApiOptions
from dsv4_worker.server.protocol import (
    CompletionRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from dsv4_worker.server.tokenizer import ByteTokenizer

VOCAB = 300
CTX = 64
CHAT_CTX = 256  # DeepSeek-V4's chat encoding costs ~50 byte tokens of special tokens
TOK = ByteTokenizer()
MSG = [{"role": "user", "content": "hi"}]
BOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def _completion(body: object) -> CompletionRequest:
    return parse_completion(body, TOK, vocab_size=VOCAB, max_context_tokens=CTX)


def _chat(body: object) -> CompletionRequest:
    return parse_chat(body, TOK, vocab_size=VOCAB, max_context_tokens=CHAT_CTX)


STRICT = ApiOptions(strict_fields=True)


def _strict_completion(body: object) -> CompletionRequest:
    return parse_completion(body, TOK, vocab_size=VOCAB, max_context_tokens=CTX, options=STRICT)


def _strict_chat(body: object) -> CompletionRequest:
    return parse_chat(body, TOK, vocab_size=VOCAB, max_context_tokens=CHAT_CTX, options=STRICT)


def _c(**fields: Any) -> dict[str, Any]:
    return {"prompt": "ab", **fields}


def _m(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, **fields}


BAD: list[tuple[str, Any, Any, str, str]] = [
    # (id, parser, body, field, message substring)
    ("body-list", _completion, [1], "", "JSON object"),
    ("body-str", _completion, "hi", "", "JSON object"),
    ("body-null", _chat, None, "", "JSON object"),
    ("unknown-field", _strict_completion, _c(bogus=2), "bogus", "allowed fields are"),
    ("unknown-lists-allowed", _strict_completion, _c(foo=1), "foo", "max_tokens"),
    ("chat-prompt-not-allowed", _strict_chat, _m(prompt="x"), "prompt", "messages"),
    (
        "completion-messages-not-allowed",
        _strict_completion,
        _c(messages=MSG),
        "messages",
        "prompt",
    ),
    ("prompt-missing", _completion, {}, "prompt", "required"),
    ("prompt-empty-str", _completion, {"prompt": ""}, "prompt", "must not be empty"),
    ("prompt-empty-list", _completion, {"prompt": []}, "prompt", "must not be empty"),
    ("prompt-null", _completion, {"prompt": None}, "prompt", "a list of token ids"),
    ("prompt-number", _completion, {"prompt": 5}, "prompt", "a list of token ids"),
    ("prompt-mixed", _completion, {"prompt": ["a", 5]}, "prompt[1]", "list of token ids"),
    ("prompt-nested", _completion, {"prompt": [[1, "x"]]}, "prompt[0][1]", "token id"),
    ("prompt-deep", _completion, {"prompt": [[[1]]]}, "prompt[0][0]", "token id"),
    ("prompt-batch-empty", _completion, {"prompt": ["a", ""]}, "prompt[1]", "must not be"),
    ("prompt-bool", _completion, {"prompt": [1, True]}, "prompt[1]", "token id"),
    ("prompt-float", _completion, {"prompt": [1, 2.0]}, "prompt[1]", "token id"),
    ("prompt-id-high", _completion, {"prompt": [1, 2, 3, VOCAB]}, "prompt[3]", "vocabulary"),
    ("prompt-id-neg", _completion, {"prompt": [-1]}, "prompt[0]", "vocabulary"),
    ("messages-missing", _chat, {}, "messages", "required"),
    ("messages-empty", _chat, {"messages": []}, "messages", "must not be empty"),
    ("messages-str", _chat, {"messages": "hi"}, "messages", "list"),
    ("message-not-obj", _chat, {"messages": ["hi"]}, "messages[0]", "object"),
    (
        "message-bad-role",
        _chat,
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
        "system, developer, user, assistant",
    ),
    (
        "message-no-role",
        _chat,
        {"messages": [{"content": "x"}]},
        "messages[0].role",
        "one of",
    ),
    (
        "message-content-part-without-text",
        _chat,
        {"messages": [*MSG, {"role": "user", "content": [{"type": "text"}]}]},
        "messages[1].content[0].text",
        "string",
    ),
    (
        "message-content-image-part",
        _chat,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        "only text parts are supported), got 'image_url'",
    ),
    (
        "message-content-number",
        _chat,
        {"messages": [{"role": "user", "content": 3}]},
        "messages[0].content",
        "a string or a list of text parts, not a number",
    ),
    (
        "message-no-content",
        _chat,
        {"messages": [{"role": "user"}]},
        "messages[0].content",
        "string",
    ),
    (
        "message-unknown-key",
        _chat,
        {"messages": [{"role": "user", "content": "x", "nick": "bob"}]},
        "messages[0].nick",
        "unknown",
    ),
    ("max-tokens-zero", _completion, _c(max_tokens=0), "max_tokens", "[1, 64]"),
    ("max-tokens-over-ctx", _completion, _c(max_tokens=CTX + 1), "max_tokens", "[1, 64]"),
    ("max-tokens-float", _completion, _c(max_tokens=4.0), "max_tokens", "integer"),
    ("max-tokens-bool", _completion, _c(max_tokens=True), "max_tokens", "integer"),
    ("max-tokens-str", _chat, _m(max_tokens="4"), "max_tokens", "integer"),
    ("temperature-neg", _completion, _c(temperature=-0.1), "temperature", "[0, 2]"),
    ("temperature-high", _completion, _c(temperature=2.5), "temperature", "[0, 2]"),
    ("temperature-huge-int", _completion, _c(temperature=10**400), "temperature", "[0, 2]"),
    ("temperature-nan", _completion, _c(temperature=math.nan), "temperature", "finite"),
    ("temperature-inf", _completion, _c(temperature=math.inf), "temperature", "finite"),
    ("temperature-str", _completion, _c(temperature="1"), "temperature", "number"),
    ("temperature-bool", _completion, _c(temperature=True), "temperature", "number"),
    ("top-p-zero", _completion, _c(top_p=0), "top_p", "(0, 1]"),
    ("top-p-high", _completion, _c(top_p=1.01), "top_p", "(0, 1]"),
    ("top-p-nan", _chat, _m(top_p=math.nan), "top_p", "finite"),
    ("top-p-neg-inf", _completion, _c(top_p=-math.inf), "top_p", "finite"),
    ("top-k-neg", _completion, _c(top_k=-2), "top_k", ">= 0"),
    ("top-k-float", _completion, _c(top_k=1.5), "top_k", "integer"),
    ("seed-neg", _completion, _c(seed=-1), "seed", "[0, 9223372036854775807]"),
    ("seed-too-big", _completion, _c(seed=2**63), "seed", "[0, 9223372036854775807]"),
    ("seed-str", _completion, _c(seed="7"), "seed", "integer"),
    ("seed-bool", _completion, _c(seed=False), "seed", "integer"),
    ("stop-empty-str", _completion, _c(stop=""), "stop", "must not be empty"),
    ("stop-empty-item", _completion, _c(stop=["x", ""]), "stop[1]", "must not be empty"),
    ("stop-too-many", _completion, _c(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    ("stop-number", _completion, _c(stop=5), "stop", "string or a list"),
    ("stop-obj", _completion, _c(stop={"a": 1}), "stop", "string or a list"),
    ("stop-id-high", _completion, _c(stop=["a", VOCAB]), "stop[1]", "vocabulary"),
    ("stop-id-neg", _completion, _c(stop=[-2]), "stop[0]", "vocabulary"),
    ("stop-nested", _completion, _c(stop=[["a"]]), "stop[0]", "string or a token id"),
    ("stop-bool", _completion, _c(stop=[True]), "stop[0]", "string or a token id"),
    ("stop-float", _completion, _c(stop=[1.0]), "stop[0]", "string or a token id"),
    ("stream-int", _completion, _c(stream=1), "stream", "boolean"),
    ("stream-str", _chat, _m(stream="true"), "stream", "boolean"),
    ("return-ids-int", _completion, _c(return_token_ids=0), "return_token_ids", "boolean"),
    ("n-zero", _completion, _c(n=0), "n", "[1, 128]"),
    ("n-huge", _completion, _c(n=129), "n", "[1, 128]"),
    ("n-float", _completion, _c(n=1.0), "n", "integer"),
    ("n-bool", _completion, _c(n=True), "n", "integer"),
    ("user-int", _completion, _c(user=3), "user", "string"),
    ("model-int", _completion, _c(model=3), "model", "string"),
    (
        "prompt-plus-max-tokens",
        _completion,
        _c(prompt=[1] * 60, max_tokens=5),
        "max_tokens",
        "prompt (60 tokens) + max_tokens (5) exceeds the maximum context of 64 tokens",
    ),
    (
        "default-max-tokens-too-many",
        _completion,
        {"prompt": "x" * 50},
        "max_tokens",
        "prompt (50 tokens) + max_tokens (16) exceeds",
    ),
    ("prompt-alone-too-long", _completion, {"prompt": [1] * 65}, "prompt", "65 tokens"),
    ("prompt-fills-context", _completion, {"prompt": "x" * 64}, "prompt", "maximum context"),
    (
        "chat-too-long",
        _chat,
        {"messages": [{"role": "user", "content": "x" * CHAT_CTX}]},
        "prompt",
        f"maximum context of {CHAT_CTX}",
    ),
]


@pytest.mark.parametrize(
    ("parse", "body", "field", "substring"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_body_is_rejected_naming_the_field(
    parse: Any, body: object, field: str, substring: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.field == field
    assert substring in str(info.value)
    assert str(info.value) == (f"{field}: {info.value.message}" if field else info.value.message)


GOOD: list[tuple[str, Any, Any, dict[str, Any]]] = [
    # (id, parser, body, expected CompletionRequest fields)
    (
        "defaults",
        _completion,
        {"prompt": "hé"},
        {
            "prompt_ids": (0x68, 0xC3, 0xA9),
            "params": SamplingParams(),
            "stop_strings": (),
            "stream": False,
            "return_token_ids": False,
            "model": None,
            "echo_prompt_text": "hé",
        },
    ),
    (
        "token-ids-prompt",
        _completion,
        {"prompt": [104, 105, 299]},  # 299 < VOCAB but has no byte: decodes to nothing
        {"prompt_ids": (104, 105, 299), "echo_prompt_text": "hi"},
    ),
    (
        "everything",
        _completion,
        _c(
            model="tiny",
            max_tokens=62,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=2**63 - 1,
            stop=["\n", 10, "END", 0],
            stream=True,
            return_token_ids=True,
            n=1,
            user="alice",
        ),
        {
            "params": SamplingParams(
                max_new_tokens=62,
                temperature=0.7,
                top_p=0.9,
                top_k=40,
                seed=2**63 - 1,
                stop_token_ids=(10, 0),
            ),
            "stop_strings": ("\n", "END"),
            "stream": True,
            "return_token_ids": True,
            "model": "tiny",
        },
    ),
    (
        "int-floats-and-bounds",
        _completion,
        _c(temperature=2, top_p=1, top_k=0, seed=0, max_tokens=1),
        {"params": SamplingParams(max_new_tokens=1, temperature=2.0, top_p=1.0, seed=0)},
    ),
    (
        "nulls-mean-defaults",
        _completion,
        _c(
            model=None,
            max_tokens=None,
            temperature=None,
            top_p=None,
            top_k=None,
            seed=None,
            stop=None,
            stream=None,
            return_token_ids=None,
            n=None,
            user=None,
        ),
        {"params": SamplingParams(), "stop_strings": (), "stream": False, "model": None},
    ),
    ("stop-single-string", _completion, _c(stop="###"), {"stop_strings": ("###",)}),
    (
        "exactly-fills-context",
        _completion,
        {"prompt": [1] * 60, "max_tokens": 4},
        {"params": SamplingParams(max_new_tokens=4)},
    ),
    (
        "chat-rendered",
        _chat,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": ""},
            ],
            "max_tokens": 2,
            "stream": True,
        },
        {
            "echo_prompt_text": f"{BOS}be brief{USER}{ASSISTANT}</think>",
            "prompt_ids": tuple(f"{BOS}be brief{USER}{ASSISTANT}</think>".encode()),
            "params": SamplingParams(max_new_tokens=2),
            "stream": True,
        },
    ),
    (
        "chat-text-parts",
        _chat,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}]},
        {"echo_prompt_text": f"{BOS}{USER}a\na{ASSISTANT}</think>"},
    ),
    (
        "unknown-top-level-fields-are-ignored-and-named",
        _completion,
        _c(bogus=2, zeta=None, max_tokens=3),
        {"ignored": ("bogus", "zeta"), "params": SamplingParams(max_new_tokens=3)},
    ),
    (
        "chat-unknown-field-ignored",
        _chat,
        _m(add_generation_prompt=True),
        {"ignored": ("add_generation_prompt",)},
    ),
]


@pytest.mark.parametrize(
    ("parse", "body", "expected"), [g[1:] for g in GOOD], ids=[g[0] for g in GOOD]
)
def test_good_body_parses(parse: Any, body: object, expected: dict[str, Any]) -> None:
    request = parse(body)
    assert isinstance(request, CompletionRequest)
    for name, value in expected.items():
        owner = request if hasattr(request, name) else request.gen
        assert getattr(owner, name) == value, name


def test_request_error_is_a_value_error_with_plain_message_for_the_body() -> None:
    err = RequestError("", "the body must be a JSON object")
    assert isinstance(err, ValueError)
    assert str(err) == "the body must be a JSON object"
    assert str(RequestError("top_k", "must be >= 0")) == "top_k: must be >= 0"
