"""DeepSeek-V4's chat encoding: messages (and the request's tools) -> the prompt text, as the
release's encoding module (`encoding_dsv4.py`, beside the weights) renders them. Pure.

    BOS [effort] system [\\n\\n TOOLS]                       (system text, no role token)
    <｜User｜> user text, tool results as <tool_result>...</tool_result>, joined by \\n\\n
    <｜Assistant｜> + <think> (thinking) or </think> (chat)  after a user turn that an assistant
                                                           turn follows, or that ends the list
    [reasoning </think>] content [\\n\\n DSML block] EOS     an assistant turn in the history

Rules kept from the release (docs/engine.md, "Chat encoding", lists the sources):
- tool messages become user turns (consecutive ones, and a user message after them, merge into
  one), their results ordered as the assistant's preceding calls were;
- the request's tools go on the first message when it is a system message, else on a new
  empty system message before it;
- thinking mode drops the reasoning of assistant turns before the last user turn (their user
  turn then opens with </think>), unless the conversation has tools: then every turn keeps it;
- reasoning effort "max" puts its instruction first (thinking mode only); other efforts add
  nothing;
- an assistant call's arguments that are not a JSON object are shown as {"arguments": text}.
NOTE: the prompt strings (the tools section, the effort instruction) are the release's,
character for character: the model was trained on them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from dsv4_worker.server.chat_messages import Message
from dsv4_worker.server.dsml import (
    ASSISTANT,
    BLOCK_LEAD,
    BOS,
    EOS,
    MARK,
    THINK_END,
    THINK_START,
    USER,
    render_block,
    to_json,
)
from dsv4_worker.server.tools import ToolSpec

Effort = Literal["low", "high", "max"]

EFFORT_MAX_PROMPT: Final = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

TOOLS_PROMPT: Final = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{MARK}tool_calls>" block like the following:

<{MARK}tool_calls>
<{MARK}invoke name="$TOOL_NAME">
<{MARK}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{MARK}parameter>
...
</{MARK}invoke>
<{MARK}invoke name="$TOOL_NAME2">
...
</{MARK}invoke>
</{MARK}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete \
reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


@dataclass(frozen=True, slots=True)
class _Turn:
    """A message as the encoding renders it (tool results merged into user turns)."""

    role: str  # system, user, assistant
    content: str = ""
    results: tuple[tuple[str | None, str], ...] = ()  # user: (tool call id, text) ...
    parts: tuple[tuple[str, str], ...] = ()  # user: ("text" | "result", text), in order
    message: Message | None = None  # assistant: the message
    tools: tuple[ToolSpec, ...] = ()  # system: the request's tools
    extra: dict[str, object] = field(default_factory=dict)


def encode(
    messages: Sequence[Message],
    tools: Sequence[ToolSpec] = (),
    *,
    thinking: bool,
    effort: Effort | None = None,
) -> str:
    """The prompt for `messages` (the generation prompt opens the assistant's reply)."""
    turns = _with_tools(_merge_tool_results(messages), tuple(tools))
    drop = not any(t.tools for t in turns)  # reasoning is kept whenever tools are in play
    last_user = max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)
    if thinking and drop:
        turns = [_without_reasoning(t) if i < last_user else t for i, t in enumerate(turns)]
    out = [BOS]
    for i, turn in enumerate(turns):
        if i == 0 and thinking and effort == "max":
            out.append(EFFORT_MAX_PROMPT)
        out.append(_render(turn, i, last_user, thinking, drop))
        follows = turns[i + 1].role if i + 1 < len(turns) else None
        if turn.role == "user" and follows in (None, "assistant"):
            opens = thinking and (not drop or i >= last_user)
            out.append(ASSISTANT + (THINK_START if opens else THINK_END))
    return "".join(out)


def _render(turn: _Turn, index: int, last_user: int, thinking: bool, drop: bool) -> str:
    if turn.role == "system":
        text = turn.content
        if turn.tools:
            text += "\n\n" + render_tools(turn.tools)
        return text
    if turn.role == "user":
        parts = [
            f"<tool_result>{body}</tool_result>" if kind == "result" else body
            for kind, body in turn.parts
        ]
        return USER + "\n\n".join(parts)
    message = turn.message
    assert message is not None
    reasoning = ""
    if thinking and (not drop or index > last_user):
        reasoning = (message.reasoning or "") + THINK_END
    calls = ""
    if message.tool_calls:
        calls = BLOCK_LEAD + render_block(
            [(c.name, _arguments(c.arguments)) for c in message.tool_calls]
        )
    return reasoning + message.content + calls + EOS


def render_tools(tools: Sequence[ToolSpec]) -> str:
    return TOOLS_PROMPT.replace("{schemas}", "\n".join(to_json(dict(t.function)) for t in tools))


def _arguments(text: str) -> Mapping[str, object]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": text}


def _merge_tool_results(messages: Sequence[Message]) -> list[_Turn]:
    """Tool results join a user turn (with the user text that follows them); each turn's
    results are ordered as the calls of the assistant turn before them were."""
    turns: list[_Turn] = []
    order: dict[str, int] = {}
    for m in messages:
        if m.role == "assistant":
            if m.tool_calls:
                order = {c.id: j for j, c in enumerate(m.tool_calls)}
            turns.append(_Turn("assistant", m.content, message=m))
        elif m.role == "tool":
            part = ("result", m.content)
            if turns and turns[-1].role == "user":
                prev = turns[-1]
                turns[-1] = replace(
                    prev,
                    results=(*prev.results, (m.tool_call_id, m.content)),
                    parts=(*prev.parts, part),
                )
            else:
                turns.append(_Turn("user", results=((m.tool_call_id, m.content),), parts=(part,)))
        elif m.role == "user":
            part = ("text", m.content)
            if turns and turns[-1].role == "user":
                prev = turns[-1]
                turns[-1] = replace(prev, parts=(*prev.parts, part))
            else:
                turns.append(_Turn("user", m.content, parts=(part,)))
        else:
            turns.append(_Turn(m.role, m.content))
        if turns[-1].role == "user" and len(turns[-1].results) > 1 and order:
            turns[-1] = _sorted_results(turns[-1], order)
    return turns


def _sorted_results(turn: _Turn, order: Mapping[str, int]) -> _Turn:
    """The turn's result parts in call order (text parts keep their places)."""
    results = [p for p in turn.parts if p[0] == "result"]
    ids = [cid for cid, _ in turn.results]
    ranked = sorted(zip(ids, results, strict=True), key=lambda r: order.get(r[0] or "", 0))
    it = iter(part for _, part in ranked)
    parts = tuple(next(it) if p[0] == "result" else p for p in turn.parts)
    return replace(turn, parts=parts, results=tuple((cid, p[1]) for cid, p in ranked))


def _with_tools(turns: list[_Turn], tools: tuple[ToolSpec, ...]) -> list[_Turn]:
    if not tools:
        return turns
    if turns and turns[0].role == "system":
        return [replace(turns[0], tools=tools), *turns[1:]]
    return [_Turn("system", "", tools=tools), *turns]


def _without_reasoning(turn: _Turn) -> _Turn:
    if turn.message is None or turn.message.reasoning is None:
        return turn
    return replace(turn, message=replace(turn.message, reasoning=None))
