"""DeepSeek-V4's chat encoding, string for string on conversations written here, following the
release's rules (docs/engine.md names the sources): the generation prompt, thinking mode and
the dropping of earlier reasoning, tools on the system prompt, tool results merged into user
turns in call order, DSML calls in the history (which the reply parser reads back)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizer_support import conv

from dsv4_worker.server.chat_messages import parse_messages
from dsv4_worker.server.dsml import ASSISTANT, BOS, EOS, USER
from dsv4_worker.server.dsv4_encoding import EFFORT_MAX_PROMPT, TOOLS_PROMPT, encode
from dsv4_worker.server.reply_parser import ReplyParser
from dsv4_worker.server.tools import parse_tools

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def enc(messages: list[dict[str, Any]], tools: list[Any] | None = None, **kw: Any) -> str:
    specs = parse_tools({"tools": tools}).specs if tools else ()
    return encode(parse_messages({"messages": messages}), specs, **kw)


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str, reasoning: str | None = None, **kw: Any) -> dict[str, Any]:
    out = {"role": "assistant", "content": text, **kw}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def test_one_user_turn_in_both_modes() -> None:
    assert enc([u("hi")], thinking=False) == f"{BOS}{USER}hi{ASSISTANT}</think>"
    assert enc([u("hi")], thinking=True) == f"{BOS}{USER}hi{ASSISTANT}<think>"


def test_system_prompt_has_no_role_token_and_developer_is_system() -> None:
    want = f"{BOS}be brief{USER}hi{ASSISTANT}</think>"
    assert enc([{"role": "system", "content": "be brief"}, u("hi")], thinking=False) == want
    assert enc([{"role": "developer", "content": "be brief"}, u("hi")], thinking=False) == want


def test_thinking_drops_the_reasoning_of_turns_before_the_last_user_turn() -> None:
    messages = [u("q1"), a("a1", "r1"), u("q2"), a("a2", "r2")]
    assert enc(messages, thinking=True) == (
        f"{BOS}{USER}q1{ASSISTANT}</think>a1{EOS}{USER}q2{ASSISTANT}<think>r2</think>a2{EOS}"
    )
    assert enc(messages, thinking=False) == (
        f"{BOS}{USER}q1{ASSISTANT}</think>a1{EOS}{USER}q2{ASSISTANT}</think>a2{EOS}"
    )
    assert enc([*messages, u("q3")], thinking=True).endswith(
        f"{USER}q2{ASSISTANT}</think>a2{EOS}{USER}q3{ASSISTANT}<think>"
    )


def test_tools_go_on_the_system_prompt_and_keep_every_turns_reasoning() -> None:
    messages = [{"role": "system", "content": "sys"}, u("q1"), a("a1", "r1"), u("q2")]
    tools_text = TOOLS_PROMPT.replace("{schemas}", json.dumps(TOOL["function"]))
    assert enc(messages, [TOOL], thinking=True) == (
        f"{BOS}sys\n\n{tools_text}{USER}q1{ASSISTANT}<think>r1</think>a1{EOS}"
        f"{USER}q2{ASSISTANT}<think>"
    )
    # No system message: the tools come on an empty one, first.
    assert enc([u("q")], [TOOL], thinking=False) == (
        f"{BOS}\n\n{tools_text}{USER}q{ASSISTANT}</think>"
    )


def test_tool_results_merge_into_one_user_turn_in_call_order() -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    messages = [
        u("go"),
        a("", tool_calls=calls),
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "o"}] * 2},
        u("thanks"),
    ]
    text = enc(messages, thinking=False)
    block = (
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    assert text == (
        f"{BOS}{USER}go{ASSISTANT}</think>\n\n{block}{EOS}"
        f"{USER}<tool_result>o\n\no</tool_result>\n\n<tool_result>two</tool_result>\n\nthanks"
        f"{ASSISTANT}</think>"
    )


def test_effort_max_adds_its_instruction_in_thinking_mode_only() -> None:
    assert enc([u("q")], thinking=True, effort="max") == (
        f"{BOS}{EFFORT_MAX_PROMPT}{USER}q{ASSISTANT}<think>"
    )
    assert enc([u("q")], thinking=True, effort="high") == enc([u("q")], thinking=True)
    assert enc([u("q")], thinking=False, effort="max") == enc([u("q")], thinking=False)


@pytest.mark.parametrize("thinking", [False, True])
def test_calls_in_the_history_parse_back_to_their_arguments(thinking: bool) -> None:
    args = {"city": 'São "Paulo"', "days": [1, 2], "deep": {"k": None}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}
    text = enc([u("q"), a("Checking.", "why", tool_calls=[call])], [TOOL], thinking=thinking)
    head = ASSISTANT + ("<think>" if thinking else "</think>")  # the generation prompt's end
    reply = text[text.index(head) + len(head) :]
    reply = reply[: reply.index(EOS)]
    parser = ReplyParser(reasoning=thinking)
    out, rest = parser.push(reply), parser.finish()
    assert (out.content + rest.content) == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls + rest.calls] == [("f", args)]


def test_conversation_helper_matches() -> None:
    assert conv([u("x")]).messages == parse_messages({"messages": [u("x")]})
