"""The grammars of tool_choice "required" and a named tool: any walk over the tokens they allow
(hypothesis picks each) is a reply of DSML calls whose arguments parse and match their tool's
schema; the release's own rendering of valid calls is accepted, invalid ones are refused;
schemas the DSML form cannot hold are a 400 naming the keyword."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_worker.engine.grammar import GrammarCompiler, allowed_tokens, schema_error
from dsv4_worker.server.dsml import BLOCK_LEAD, THINK_END, render_block
from dsv4_worker.server.fields import RequestError
from dsv4_worker.server.reply_parser import ReplyParser
from dsv4_worker.server.tokenizer import ByteTokenizer
from dsv4_worker.server.tool_grammar import reasoning_then_json, tools_grammar
from dsv4_worker.server.tools import Tools, parse_tools

VOCAB = 300
BYTES = GrammarCompiler(ByteTokenizer(), VOCAB)
MAX_WALK = 2500  # bytes; far more than the longest reply these schemas allow
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH: dict[str, Any] = {
    "type": "object",
    "properties": {
        "q": {"$ref": "#/$defs/short"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["q"],
    "$defs": {"short": {"type": "string", "maxLength": 3}},
}
NOW: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "now": NOW}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


def tools(choice: Any, parallel: bool = True, schemas: list[Any] | None = None) -> Tools:
    return parse_tools(
        {"tools": schemas or TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    )


def grammar(t: Tools, thinking: bool = False) -> str:
    text = tools_grammar(t.specs, t.choice, thinking=thinking)
    assert schema_error(text) is None
    return text


def walk(spec: str, picks: st.DataObject) -> str:
    """Take any allowed token until the matcher is done: the text written."""
    matcher = BYTES.matcher(spec)
    out: list[int] = []
    for _ in range(MAX_WALK):
        if matcher.done:
            return bytes(out).decode("utf-8")
        allowed = allowed_tokens([matcher], VOCAB, torch.device("cpu"))[0]
        choices = torch.nonzero(allowed).flatten().tolist()
        assert choices, f"a valid prefix allows no token: {bytes(out)!r}"
        token = picks.draw(st.sampled_from(choices))
        assert matcher.accept(token)
        out.append(token)
    raise AssertionError(f"not done after {MAX_WALK} bytes: {bytes(out)!r}")


def calls_in(text: str) -> list[tuple[str, Any]]:
    parser = ReplyParser(reasoning=False)
    out, rest = parser.push(text), parser.finish()
    assert out.content + rest.content == "" and out.reasoning + rest.reasoning == ""
    return [(c.name, json.loads(c.arguments)) for c in out.calls + rest.calls]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_walk_of_required_is_calls_that_match_their_schemas(picks: st.DataObject) -> None:
    calls = calls_in(walk(grammar(tools("required")), picks))
    assert calls
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_named_tool_or_no_parallel_calls_is_exactly_one_call(picks: st.DataObject) -> None:
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    [(name, args)] = calls_in(walk(grammar(named), picks))
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER)
    [(name, args)] = calls_in(walk(grammar(tools("required", parallel=False)), picks))
    jsonschema.validate(args, SCHEMAS[name])


def accepts(spec: str, text: str) -> bool:
    matcher = BYTES.matcher(spec)
    return all(matcher.accept(b) for b in text.encode()) and matcher.done


def test_the_release_rendering_of_valid_calls_is_accepted_and_invalid_refused() -> None:
    plain = [
        {
            "type": "function",
            "function": {
                "name": "note",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
                    "required": ["text"],
                },
            },
        }
    ]
    spec = grammar(tools("required", schemas=plain))
    ok = 'a "quoted" <b>text</b> with </｜DSML｜invoke> in it'  # a raw string: anything
    assert accepts(spec, BLOCK_LEAD + render_block([("note", {"text": ok, "n": 3})]))
    assert accepts(spec, BLOCK_LEAD + render_block([("note", {"text": ""})]))
    assert not accepts(spec, BLOCK_LEAD + render_block([("note", {"n": 3})]))  # required
    assert not accepts(spec, BLOCK_LEAD + render_block([("note", {"text": "x", "n": "3"})]))
    assert not accepts(spec, BLOCK_LEAD + render_block([("note", {"text": "x", "m": 1})]))
    assert not accepts(spec, BLOCK_LEAD + render_block([("other", {"text": "x"})]))
    assert not accepts(spec, "Sure. " + BLOCK_LEAD + render_block([("note", {"text": "x"})]))
    thinking = grammar(tools("required", schemas=plain), thinking=True)
    reply = "I will note it." + THINK_END + BLOCK_LEAD + render_block([("note", {"text": "x"})])
    assert accepts(thinking, reply)
    answer = reasoning_then_json('{"type": "object", "required": ["a"]}')
    assert accepts(answer, 'hmm</think>{"a": 1}') and not accepts(answer, '{"a": 1}')


@pytest.mark.parametrize(
    ("parameters", "where", "message"),
    [
        ({"type": "object", "minProperties": 1}, "tools[0].function.parameters", "minProperties"),
        ({"type": "array"}, "tools[0].function.parameters.type", '"object"'),
        (
            {"type": "object", "required": ["x"]},
            "tools[0].function.parameters.required",
            "not a property",
        ),
        (
            {"type": "object", "properties": {'a"b': {"type": "integer"}}},
            "tools[0].function.parameters.properties",
            "DSML name",
        ),
    ],
)
def test_schemas_the_dsml_form_cannot_hold_are_refused(
    parameters: dict[str, Any], where: str, message: str
) -> None:
    t = tools(
        "required",
        schemas=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    )
    with pytest.raises(RequestError) as info:
        tools_grammar(t.specs, t.choice, thinking=False)
    assert info.value.field == where and message in info.value.message
