"""Every field of the current OpenAI API parses (the field lists come from the installed
official client's request types): null and default values are always accepted, the fields a
serving engine honors become sampling parameters and output options, and a field asking for
what this server cannot do is a 400 naming it. `model` must name a served model (404
model_not_found)."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.generation import MAX_CHOICES, choice_params
from dsv4_worker.server.protocol import (
    CompletionRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from dsv4_worker.server.tokenizer import ByteTokenizer

VOCAB = 300
CTX = 64
CHAT_CTX = 2048  # DeepSeek-V4's encoding, its tools section most, costs many byte tokens
MSG = [{"role": "user", "content": "hi"}]
EOS = 7


class EosTokenizer(ByteTokenizer):
    """Bytes, with byte 7 as EOS."""

    def __init__(self) -> None:
        super().__init__()
        self.eos_token_id = EOS
        self.eos_token_ids = (EOS,)


TOK = EosTokenizer()


def completion(body: dict[str, Any], models: tuple[str, ...] = ()) -> CompletionRequest:
    return parse_completion(body, TOK, vocab_size=VOCAB, max_context_tokens=CTX, models=models)


def chat(body: dict[str, Any], models: tuple[str, ...] = ()) -> CompletionRequest:
    return parse_chat(body, TOK, vocab_size=VOCAB, max_context_tokens=CHAT_CTX, models=models)


def fields_of(typed_dict: type) -> list[str]:
    return sorted(typing.get_type_hints(typed_dict))


COMPLETION_FIELDS = fields_of(completion_create_params.CompletionCreateParamsBase)
CHAT_FIELDS = fields_of(chat_create_params.CompletionCreateParamsBase)


def test_the_client_lists_the_fields_we_expect() -> None:
    """A guard on the lists the next tests derive from: a new client adds fields, the
    parser must know them."""
    assert {"prompt", "echo", "logprobs", "best_of", "suffix", "n"} <= set(COMPLETION_FIELDS)
    assert {"messages", "max_completion_tokens", "tools", "top_logprobs"} <= set(CHAT_FIELDS)


@pytest.mark.parametrize("field", [f for f in COMPLETION_FIELDS if f not in ("prompt",)])
def test_every_completion_field_accepts_null(field: str) -> None:
    req = completion({"prompt": "ab", field: None})
    assert req.params.max_new_tokens == 16 and req.gen.n == 1


@pytest.mark.parametrize("field", [f for f in CHAT_FIELDS if f not in ("messages",)])
def test_every_chat_field_accepts_null(field: str) -> None:
    req = chat({"messages": MSG, field: None})
    # Chat's default length: what the context leaves after the prompt (vLLM's rule).
    assert req.params.max_new_tokens == CHAT_CTX - len(req.prompt_ids)
    assert req.gen.logprobs is None


def test_all_nulls_at_once() -> None:
    completion({"prompt": "ab", **{f: None for f in COMPLETION_FIELDS if f != "prompt"}})
    chat({"messages": MSG, **{f: None for f in CHAT_FIELDS if f != "messages"}})


TOOL_F = {"type": "function", "function": {"name": "f"}}
CHAT_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "logprobs": False,
    "top_logprobs": 0,
    "max_tokens": 16,
    "n": 1,
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "parallel_tool_calls": True,
    "store": False,
    "service_tier": "auto",
    "metadata": {"team": "a"},
    "modalities": ["text"],
    "response_format": {"type": "text"},
    "reasoning_effort": "none",
    "verbosity": "medium",
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit"},
    "prompt_cache_retention": "in_memory",
    "safety_identifier": "s",
    "user": "u",
    "seed": 1,
    "stop": None,
    "stream": False,
    "stream_options": {"include_usage": False, "include_obfuscation": True},
    "temperature": 0,
    "top_p": 1,
}
COMPLETION_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "logprobs": None,
    "max_tokens": 16,
    "n": 1,
    "seed": 0,
    "stop": [],
    "stream_options": {"include_usage": False},
    "suffix": "",
    "temperature": 0.0,
    "top_p": 1.0,
    "user": "u",
}


def test_default_values_are_accepted_and_change_nothing() -> None:
    assert set(CHAT_DEFAULTS) - {"stream"} <= set(CHAT_FIELDS)  # stream: in the subtypes
    assert set(COMPLETION_DEFAULTS) <= set(COMPLETION_FIELDS)
    req = chat({"messages": MSG, **CHAT_DEFAULTS})
    assert req.params == SamplingParams(seed=1, stop_token_ids=(EOS,))
    req = completion({"prompt": "ab", **COMPLETION_DEFAULTS})
    assert req.params == SamplingParams(seed=0, stop_token_ids=(EOS,))
    assert req.gen.logprobs is None and not req.gen.echo


def test_honored_fields_become_parameters() -> None:
    req = completion(
        {
            "prompt": ["ab", [104, 105]],
            "n": 3,
            "best_of": 3,
            "seed": 5,
            "temperature": 0.8,
            "top_k": 4,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"104": -100, "7": 2.5},
            "min_tokens": 3,
            "stop_token_ids": [9],
            "stop": ["zz", 11],
            "logprobs": 2,
            "echo": True,
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "include_stop_str_in_output": True,
            "return_token_ids": True,
        }
    )
    assert [p.ids for p in req.prompts] == [(97, 98), (104, 105)]
    assert req.params == SamplingParams(
        max_new_tokens=10,
        temperature=0.8,
        top_k=4,
        seed=5,
        stop_token_ids=(11, 9, EOS),
        min_p=0.05,
        min_tokens=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((7, 2.5), (104, -100.0)),
        logprobs=2,
        prompt_logprobs=2,
    )
    g = req.gen
    assert (g.n, g.logprobs, g.echo, g.generate, g.stream) == (3, 2, True, True, True)
    assert g.include_usage and g.continuous_usage and g.include_stop_str and g.return_token_ids
    assert req.stop_strings == ("zz",)
    assert [choice_params(req.params, i).seed for i in range(3)] == [5, 6, 7]


def test_chat_logprobs_max_completion_tokens_and_ignore_eos() -> None:
    req = chat(
        {
            "messages": MSG,
            "logprobs": True,
            "top_logprobs": 5,
            "max_tokens": 3,
            "max_completion_tokens": 9,
            "ignore_eos": True,
            "top_k": -1,
        }
    )
    assert req.params == SamplingParams(max_new_tokens=9, logprobs=5)  # no EOS stop id
    assert req.gen.logprobs == 5
    assert chat({"messages": MSG, "logprobs": True}).params.logprobs == 0


def test_echo_without_new_tokens_scores_the_prompt() -> None:
    req = completion({"prompt": "abc", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert not req.gen.generate and req.params.max_new_tokens == 1
    assert req.params.prompt_logprobs == 1


def test_chat_messages_in_every_text_form() -> None:
    req = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "name": "ann", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [], "refusal": None},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "refusal", "refusal": "no"},
                        {"type": "text", "text": "ok"},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "go",
                            "prompt_cache_breakpoint": {"mode": "explicit"},
                        }
                    ],
                },
            ]
        },
        TOK,
        vocab_size=VOCAB,
        max_context_tokens=256,
    )
    # DeepSeek-V4's encoding: developer is the system prompt; an assistant turn ends with EOS.
    assert req.echo_prompt_text == (
        "<｜begin▁of▁sentence｜>be brief<｜User｜>hi<｜Assistant｜></think>"
        "<｜end▁of▁sentence｜>no\nok<｜end▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>"
    )


def test_tool_fields_in_every_form() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert chat({"messages": MSG, "tools": [tool], "tool_choice": "none"}).reply is not None
    chat({"messages": MSG, "tool_choice": "auto"})  # nothing to call
    none = chat({"messages": MSG, "functions": [{"name": "f"}], "function_call": "none"})
    assert none.reply is not None and none.reply.callable == frozenset()
    auto = chat({"messages": MSG, "functions": [{"name": "f"}]})
    assert auto.reply is not None and auto.reply.callable == {"f"}
    assert "## Tools" in auto.echo_prompt_text and auto.params.json_schema is None
    named = chat(
        {
            "messages": MSG,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    assert named.params.json_schema is not None and named.params.json_schema.startswith(
        "%llguidance"
    )


BAD: list[tuple[str, Any, dict[str, Any], str, str]] = [
    ("logprobs-high", completion, {"prompt": "a", "logprobs": 21}, "logprobs", "[0, 20]"),
    ("logprobs-bool", completion, {"prompt": "a", "logprobs": True}, "logprobs", "integer"),
    ("top-alone", chat, {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    (
        "top-high",
        chat,
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "[0, 20]",
    ),
    ("presence", completion, {"prompt": "a", "presence_penalty": 3}, "presence_penalty", "[-2"),
    (
        "frequency",
        chat,
        {"messages": MSG, "frequency_penalty": -2.5},
        "frequency_penalty",
        "[-2",
    ),
    (
        "repetition",
        completion,
        {"prompt": "a", "repetition_penalty": 0},
        "repetition_penalty",
        "(0, 2]",
    ),
    ("bias-key", completion, {"prompt": "a", "logit_bias": {"a": 1}}, "logit_bias.a", "token"),
    (
        "bias-vocab",
        completion,
        {"prompt": "a", "logit_bias": {"300": 1}},
        "logit_bias.300",
        "vocabulary",
    ),
    (
        "bias-range",
        chat,
        {"messages": MSG, "logit_bias": {"5": 101}},
        "logit_bias.5",
        "[-100, 100]",
    ),
    ("bias-list", completion, {"prompt": "a", "logit_bias": [1]}, "logit_bias", "object"),
    (
        "min-tokens",
        completion,
        {"prompt": "a", "min_tokens": 5, "max_tokens": 4},
        "min_tokens",
        "at most max_tokens (4)",
    ),
    ("stop-ids", completion, {"prompt": "a", "stop_token_ids": [300]}, "stop_token_ids[0]", ""),
    (
        "stream-options-key",
        completion,
        {"prompt": "a", "stream_options": {"x": 1}},
        "stream_options.x",
        "unknown",
    ),
    (
        "stream-options-type",
        chat,
        {"messages": MSG, "stream_options": {"include_usage": "yes"}},
        "include_usage",
        "boolean",
    ),
    (
        "json-schema-nameless",
        completion,
        {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.name",
        "non-empty string",
    ),
    (
        "json-schema-missing",
        chat,
        {"messages": MSG, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "object",
    ),
    (
        "json-schema-invalid",
        chat,
        {
            "messages": MSG,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
        "response_format.json_schema.schema",
        "nonsense",
    ),
    (
        "json-schema-dangling-ref",
        completion,
        {
            "prompt": "a",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}},
            },
        },
        "response_format.json_schema.schema",
        "missing",
    ),
    (
        "json-schema-strict-type",
        chat,
        {
            "messages": MSG,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": 1}},
        },
        "response_format.json_schema.strict",
        "bool",
    ),
    (
        "format-type",
        chat,
        {"messages": MSG, "response_format": {"type": "xml"}},
        "response_format.type",
        "json_schema",
    ),
    ("suffix", completion, {"prompt": "a", "suffix": "x"}, "suffix", "fill-in-the-middle"),
    ("best-of", completion, {"prompt": "a", "best_of": 3}, "best_of", "never ranked"),
    ("zero-tokens", completion, {"prompt": "a", "max_tokens": 0}, "max_tokens", "[1, 64]"),
    (
        "zero-chat",
        chat,
        {"messages": MSG, "max_completion_tokens": 0},
        "max_completion_tokens",
        f"[1, {CHAT_CTX}]",
    ),
    ("tool-required", chat, {"messages": MSG, "tool_choice": "required"}, "tool_choice", "tool"),
    (
        "tool-named-unknown",
        chat,
        {"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
        "not one of the tools",
    ),
    (
        "tool-bad-name",
        chat,
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "1-64 characters",
    ),
    (
        "tool-type",
        chat,
        {"messages": MSG, "tools": [{"type": "web_search"}]},
        "tools[0].type",
        '"function"',
    ),
    (
        "functions-and-tools",
        chat,
        {"messages": MSG, "functions": [{"name": "f"}], "tools": [TOOL_F]},
        "functions",
        "not both",
    ),
    (
        "thinking-switches-disagree",
        chat,
        {
            "messages": MSG,
            "thinking": {"type": "enabled"},
            "chat_template_kwargs": {"thinking": False},
        },
        "thinking.type",
        "disagrees with chat_template_kwargs.thinking",
    ),
    (
        "thinking-type",
        chat,
        {"messages": MSG, "thinking": {"type": "on"}},
        "thinking.type",
        '"enabled" or "disabled"',
    ),
    (
        "template-kwargs-reserved",
        chat,
        {"messages": MSG, "chat_template_kwargs": {"messages": []}},
        "chat_template_kwargs.messages",
        "set by the server",
    ),
    (
        "required-with-response-format",
        chat,
        {
            "messages": MSG,
            "tools": [TOOL_F],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "response_format",
        "tool calls",
    ),
    ("audio", chat, {"messages": MSG, "audio": {"voice": "x"}}, "audio", "audio"),
    ("modalities", chat, {"messages": MSG, "modalities": ["text", "audio"]}, "modalities", ""),
    ("store", chat, {"messages": MSG, "store": True}, "store", "nothing is stored"),
    ("reasoning", chat, {"messages": MSG, "reasoning_effort": "huge"}, "reasoning_effort", "one"),
    ("verbosity", chat, {"messages": MSG, "verbosity": "low"}, "verbosity", "medium"),
    ("search", chat, {"messages": MSG, "web_search_options": {}}, "web_search_options", ""),
    ("moderation", chat, {"messages": MSG, "moderation": {"model": "m"}}, "moderation", ""),
    ("tier", chat, {"messages": MSG, "service_tier": "gold"}, "service_tier", "one of"),
    (
        "tool-message-without-id",
        chat,
        {"messages": [{"role": "tool", "content": "1"}]},
        "messages[0].tool_call_id",
        "required",
    ),
    (
        "tool-calls-without-function",
        chat,
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
        "object",
    ),
    (
        "user-tool-call-id",
        chat,
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
        "messages[0].tool_call_id",
        "not a field",
    ),
    (
        "user-null-content",
        chat,
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content",
        "string",
    ),
    (
        "audio-part",
        chat,
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        "messages[0].content[0].type",
        "only text parts",
    ),
    (
        "file-part",
        chat,
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
        "messages[0].content[0].type",
        "only text parts",
    ),
    (
        "user-refusal-part",
        chat,
        {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]},
        "messages[0].content[0].type",
        "only text parts",
    ),
    ("surrogate-prompt", completion, {"prompt": "a\ud800"}, "prompt", "lone surrogate \\ud800"),
    ("surrogate-batch", completion, {"prompt": ["a", "\udfff"]}, "prompt[1]", "surrogate"),
    ("surrogate-stop", completion, {"prompt": "a", "stop": ["\ud800"]}, "stop[0]", "surrogate"),
    (
        "surrogate-message",
        chat,
        {"messages": [{"role": "user", "content": "\ud83d"}]},
        "messages[0].content",
        "surrogate",
    ),
    (
        "choices",
        completion,
        {"prompt": ["a"] * 5, "n": MAX_CHOICES // 4},
        "n",
        f"at most {MAX_CHOICES}",
    ),
    ("skip-special", completion, {"prompt": "a", "skip_special_tokens": False}, "", "true"),
]


@pytest.mark.parametrize(
    ("parse", "body", "field", "substring"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_what_cannot_be_honored_is_a_400_naming_the_field(
    parse: Any, body: dict[str, Any], field: str, substring: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.status == 400
    assert info.value.field.endswith(field), info.value
    assert substring in info.value.message


def test_model_must_name_a_served_model() -> None:
    served = ("tiny", "alias")
    assert completion({"prompt": "a", "model": "alias"}, served).model == "alias"
    assert completion({"prompt": "a"}, served).model is None  # absent: the served one
    assert chat({"messages": MSG, "model": None}, served).model is None
    for parse, body in ((completion, {"prompt": "a"}), (chat, {"messages": MSG})):
        with pytest.raises(RequestError) as info:
            parse({**body, "model": "gpt-4o", "temperature": -1}, served)  # checked first
        assert (info.value.status, info.value.code, info.value.field) == (
            404,
            "model_not_found",
            "model",
        )
        assert "gpt-4o" in info.value.message and "tiny" in info.value.message
