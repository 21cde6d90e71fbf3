"""DeepSeek-V4's markup for tool calls (DSML) and its other protocol tags, as the release's
encoding module writes them: the strings, the rendering of one call, and the decoding of one
call's parameters into OpenAI's JSON `arguments`. Pure.

    block      <｜DSML｜tool_calls>\\n INVOKE (\\n INVOKE)* \\n</｜DSML｜tool_calls>
               (an assistant turn puts "\\n\\n" before the block)
    INVOKE     <｜DSML｜invoke name="NAME">\\n PARAM (\\n PARAM)* \\n</｜DSML｜invoke>
    PARAM      <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>

A string value is written as it is (string="true"); any other value as JSON (string="false").
NOTE: decoding always yields a JSON object: a string="false" value that is not JSON (or is
NaN/Infinity, which JSON cannot carry) becomes a string, as does a value without the
attribute that does not parse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

BOS: Final = "<｜begin▁of▁sentence｜>"
EOS: Final = "<｜end▁of▁sentence｜>"
USER: Final = "<｜User｜>"
ASSISTANT: Final = "<｜Assistant｜>"
THINK_START: Final = "<think>"
THINK_END: Final = "</think>"
MARK: Final = "｜DSML｜"
BLOCK_NAME: Final = "tool_calls"
BLOCK_OPEN: Final = f"<{MARK}{BLOCK_NAME}>"
BLOCK_CLOSE: Final = f"</{MARK}{BLOCK_NAME}>"
INVOKE_CLOSE: Final = f"</{MARK}invoke>"
PARAM_CLOSE: Final = f"</{MARK}parameter>"
BLOCK_LEAD: Final = "\n\n"  # between an assistant's content and its block


def invoke_open(name: str) -> str:
    return f'<{MARK}invoke name="{name}">'


def param_open(key: str, is_string: bool) -> str:
    return f'<{MARK}parameter name="{key}" string="{"true" if is_string else "false"}">'


def to_json(value: object) -> str:
    """JSON as the release writes it: non-ASCII kept, json.dumps's separators."""
    return json.dumps(value, ensure_ascii=False)


def render_params(arguments: Mapping[str, object]) -> str:
    """One call's arguments as DSML parameters, one per line."""
    lines = []
    for key, value in arguments.items():
        is_string = isinstance(value, str)
        text = value if isinstance(value, str) else to_json(value)
        lines.append(f"{param_open(key, is_string)}{text}{PARAM_CLOSE}")
    return "\n".join(lines)


def render_block(calls: Sequence[tuple[str, Mapping[str, object]]]) -> str:
    """A whole tool-call block (without the lead) for (name, arguments) calls."""
    invokes = [
        f"{invoke_open(name)}\n{render_params(args)}\n{INVOKE_CLOSE}" for name, args in calls
    ]
    return BLOCK_OPEN + "\n" + "\n".join(invokes) + "\n" + BLOCK_CLOSE


def decode_value(text: str, is_string: bool | None) -> object:
    """A parameter's value: the text itself (string="true"), else its JSON (a string when the
    text is not JSON); `None` (no attribute): JSON when it parses, else the text."""
    if is_string:
        return text
    try:
        return json.loads(text.strip(), parse_constant=_no_constant)
    except ValueError:
        return text


def arguments_json(params: Sequence[tuple[str, str, bool | None]]) -> str:
    """OpenAI's `arguments` for (key, value text, string flag) parameters: a JSON object
    (a key given twice keeps its last value)."""
    args: dict[str, Any] = {}
    for key, text, is_string in params:
        args[key] = decode_value(text, is_string)
    return to_json(args)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")
