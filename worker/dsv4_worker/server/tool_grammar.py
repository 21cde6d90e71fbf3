"""Grammars (llguidance's Lark dialect) that make a reply what the request demands: tool calls in
DSML for tool_choice "required" or a named tool, and response_format's JSON after the
reasoning in thinking mode. Pure: it writes grammar text; `engine/grammar.py` compiles it.

    start     [REASONING "</think>"] "\\n\\n" BLOCK             (required, named)
    BLOCK     <｜DSML｜tool_calls> INVOKE+ \\n</｜DSML｜tool_calls>  (INVOKE once: named, or
                                                                 parallel_tool_calls false)
    INVOKE    one of the tools, its parameters in a fixed order: the required ones, then
              each optional one or not, as the schema lists them; a plain string property
              is written raw (string="true"), any other as JSON its schema accepts
              (string="false"); a tool without properties that allows any takes any

So the arguments always parse and match the tool's schema: the grammar holds each property's
schema, the required ones and no others. A schema whose object-level keywords the DSML form
cannot hold (patternProperties, minProperties, allOf at the top, ...) is a 400 naming it.
NOTE: every literal starts with the separator before it ("\\n<...") so no literal is a prefix
of another: llguidance's lexer does not split a matched literal again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from dsv4_worker.engine.grammar import JSON_FORM, LARK_HEADER
from dsv4_worker.server.dsml import (
    BLOCK_CLOSE,
    BLOCK_LEAD,
    BLOCK_OPEN,
    INVOKE_CLOSE,
    PARAM_CLOSE,
    THINK_END,
    invoke_open,
    param_open,
)
from dsv4_worker.server.fields import RequestError
from dsv4_worker.server.tools import ToolChoice, ToolSpec

# Keywords of a tool's `parameters` the grammar holds (or that constrain nothing).
_ROOT_KEYWORDS: Final = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "description",
        "title",
        "$defs",
        "definitions",
        "$schema",
        "$id",
        "examples",
        "default",
        "strict",
    }
)
_KEYWORD_LIST: Final = ", ".join(sorted(_ROOT_KEYWORDS))
_PLAIN_STRING_KEYWORDS: Final = frozenset({"type", "description", "title", "examples", "default"})


def tools_grammar(
    tools: Sequence[ToolSpec], choice: ToolChoice, *, thinking: bool, where: str = "tools"
) -> str:
    """The grammar of a reply that is only tool calls (choice "required" or named)."""
    assert choice.constrained
    chosen = [
        (i, t) for i, t in enumerate(tools) if choice.mode != "named" or t.name == choice.name
    ]
    rules = [LARK_HEADER]
    lead = _lit(BLOCK_LEAD + BLOCK_OPEN)
    calls = "call+" if choice.parallel and choice.mode == "required" else "call"
    rules.append(
        f"start: {'think ' if thinking else ''}{lead} {calls} {_lit(chr(10) + BLOCK_CLOSE)}"
    )
    if thinking:
        rules.append(_think_rule())
    rules.append("call: " + " | ".join(f"call_{i}" for i, _ in chosen))
    for i, tool in chosen:
        rules.extend(_invoke_rules(i, tool, f"{where}[{i}].function.parameters"))
    rules.append(f"raw[lazy]: /(?s:.*){_regex_text(PARAM_CLOSE)}/")
    return "\n".join(rules) + "\n"


def reasoning_then_json(schema: str) -> str:
    """response_format in thinking mode: the reasoning, </think>, then the JSON."""
    body = _with_form(json.loads(schema))
    return (
        "\n".join(
            [LARK_HEADER, "start: think answer", _think_rule(), f"answer: %json {json.dumps(body)}"]
        )
        + "\n"
    )


def _think_rule() -> str:
    return f"think[lazy]: /(?s:.*){_regex_text(THINK_END)}/"


def _invoke_rules(i: int, tool: ToolSpec, where: str) -> list[str]:
    schema = tool.parameters
    unknown = sorted(str(k) for k in schema if k not in _ROOT_KEYWORDS)
    if unknown:
        raise RequestError(
            where,
            f"the keyword {unknown[0]!r} cannot be enforced on DSML parameters (tool_choice "
            f'"required" or a named tool); the keywords that can: {_KEYWORD_LIST}',
        )
    kind = schema.get("type", "object")
    if kind != "object":
        raise RequestError(f"{where}.type", f'must be "object", got {kind!r}')
    props = schema.get("properties") or {}
    if not isinstance(props, dict):
        raise RequestError(f"{where}.properties", "must be an object")
    required = schema.get("required") or []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise RequestError(f"{where}.required", "must be a list of property names")
    for name in required:
        if name not in props:
            raise RequestError(f"{where}.required", f"names {name!r}, which is not a property")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    head = _lit("\n" + invoke_open(tool.name))
    tail = _lit("\n" + INVOKE_CLOSE)
    rules: list[str] = []
    if not props:
        if schema.get("additionalProperties", True) is False:
            return [f"call_{i}: {head} {_lit(chr(10))} {tail}"]
        rules.append(f"call_{i}: {head} any_param_{i}* {tail}")
        name_open = "\n" + param_open("", True).split('"')[0] + '"'
        rules.append(
            f"any_param_{i}: {_lit(name_open)} KEY_{i} "
            f"({_lit(chr(34) + ' string=' + chr(34) + 'true' + chr(34) + '>')} raw | "
            f"{_lit(chr(34) + ' string=' + chr(34) + 'false' + chr(34) + '>')} json_any_{i} "
            f"{_lit(PARAM_CLOSE)})"
        )
        rules.append(f'KEY_{i}: /[^"<>\\n]+/')
        rules.append(f"json_any_{i}: %json {json.dumps(_with_form({}))}")
        return rules
    order = [k for k in props if k in required] + [k for k in props if k not in required]
    parts = []
    for j, key in enumerate(order):
        if not isinstance(key, str) or '"' in key or not key or "\n" in key:
            raise RequestError(
                f"{where}.properties", f"the property name {key!r} cannot be a DSML name"
            )
        sub = props[key]
        if not isinstance(sub, dict):
            raise RequestError(f"{where}.properties.{key}", "must be a JSON schema object")
        rule = f"p_{i}_{j}"
        if _plain_string(sub):
            rules.append(f"{rule}: {_lit(chr(10) + param_open(key, True))} raw")
        else:
            body = _with_form({**defs, **sub})
            rules.append(
                f"{rule}: {_lit(chr(10) + param_open(key, False))} v_{i}_{j} {_lit(PARAM_CLOSE)}"
            )
            rules.append(f"v_{i}_{j}: %json {json.dumps(body)}")
        parts.append(rule if key in required else f"{rule}?")
    rules.insert(0, f"call_{i}: {head} {' '.join(parts)} {tail}")
    return rules


def _plain_string(schema: Mapping[str, Any]) -> bool:
    return schema.get("type") == "string" and set(schema) <= _PLAIN_STRING_KEYWORDS


def _with_form(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with this server's JSON form (no free whitespace)."""
    return {**schema, "x-guidance": dict(JSON_FORM)}


def _lit(text: str) -> str:
    """A Lark string literal."""
    return '"' + _lark_inner(text) + '"'


def _lark_inner(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _regex_text(text: str) -> str:
    """`text` inside a /regex/: every character taken literally."""
    out = []
    for c in text:
        out.append("\\" + c if c in r"\/.^$|?*+()[]{}" else c)
    return "".join(out)
