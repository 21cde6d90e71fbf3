"""The `messages` of a chat request, parsed into `Message`s. Pure.

    role        fields read                                      becomes
    system      content, name                                    system
    developer   content, name                                    system (OpenAI's new name)
    user        content, name                                    user
    assistant   content (may be null), name, refusal,            assistant
                tool_calls [{id, type: "function", function:
                {name, arguments}}], function_call (legacy),
                reasoning_content (or reasoning: vLLM's name)
    tool        content, tool_call_id                            tool
    function    content, name (legacy)                           tool (named by `name`)

Content is a string or a list of text parts (joined with "\\n"; a tool's with "\\n\\n", as
DeepSeek-V4's encoding joins tool results); image, audio and file parts are refused naming
the part. `as_template_dict` is what a HuggingFace chat template sees: OpenAI's shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_worker.server.fields import (
    RequestError,
    json_type,
    optional_str,
    refuse_unless,
    text,
    unknown_fields,
)

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
PART_SEPARATOR = "\n"  # between the text parts of one message
TOOL_PART_SEPARATOR = "\n\n"  # between the text parts of a tool result
_MESSAGE_FIELDS = frozenset(
    {
        "role",
        "content",
        "name",
        "tool_calls",
        "tool_call_id",
        "function_call",
        "refusal",
        "audio",
        "reasoning_content",
        "reasoning",
    }
)
_ASSISTANT_ONLY = ("tool_calls", "function_call", "refusal", "audio", "reasoning_content")
_TEXT_PART_FIELDS = frozenset({"type", "text", "prompt_cache_breakpoint"})
_REFUSAL_PART_FIELDS = frozenset({"type", "refusal"})
_CALL_FIELDS = frozenset({"id", "type", "function"})
_FUNCTION_FIELDS = frozenset({"name", "arguments"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # as the client sent it (normally a JSON object)


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # system, user, assistant or tool
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # tool results
    reasoning: str | None = None  # an assistant's reasoning_content

    def as_template_dict(self) -> dict[str, Any]:
        """The message as HuggingFace chat templates read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out


def parse_messages(obj: Mapping[str, object]) -> tuple[Message, ...]:
    if "messages" not in obj:
        raise RequestError("messages", "is required")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise RequestError("messages", f"must be a list of objects, not {json_type(messages)}")
    if not messages:
        raise RequestError("messages", "must not be empty")
    return tuple(_parse_message(f"messages[{i}]", m) for i, m in enumerate(messages))


def _parse_message(where: str, message: object) -> Message:
    if not isinstance(message, dict):
        raise RequestError(where, f"must be an object, not {json_type(message)}")
    unknown_fields(message, _MESSAGE_FIELDS, where)
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    assert isinstance(role, str)
    name = _optional_text(message, "name", where)
    if role == "assistant":
        return _assistant(where, message, name)
    for key in (*_ASSISTANT_ONLY, "reasoning"):
        if key in message:
            raise RequestError(f"{where}.{key}", f"is not a field of a {role} message")
    if role in ("tool", "function"):
        call_id = _optional_text(message, "tool_call_id", where)
        if role == "function":
            if name is None:
                raise RequestError(f"{where}.name", "is required in a function message")
        elif call_id is None:
            raise RequestError(f"{where}.tool_call_id", "is required in a tool message")
        content = _content(f"{where}.content", message, TOOL_PART_SEPARATOR, nullable=True)
        return Message("tool", content, name=name, tool_call_id=call_id)
    if "tool_call_id" in message:
        raise RequestError(f"{where}.tool_call_id", f"is not a field of a {role} message")
    content = _content(f"{where}.content", message, PART_SEPARATOR, nullable=False)
    return Message("system" if role == "developer" else role, content, name=name)


def _assistant(where: str, message: Mapping[str, object], name: str | None) -> Message:
    refuse_unless(message, "audio", lambda _: False, "audio is not supported", where)
    optional_str(message, "refusal")
    if "tool_call_id" in message:
        raise RequestError(f"{where}.tool_call_id", "is not a field of an assistant message")
    calls = _tool_calls(where, message)
    reasoning = _optional_text(message, "reasoning_content", where)
    if reasoning is None:
        reasoning = _optional_text(message, "reasoning", where)
    content = _content(f"{where}.content", message, PART_SEPARATOR, nullable=True)
    return Message("assistant", content, name=name, tool_calls=calls, reasoning=reasoning)


def _tool_calls(where: str, message: Mapping[str, object]) -> tuple[ToolCall, ...]:
    calls = message.get("tool_calls")
    legacy = message.get("function_call")
    out: list[ToolCall] = []
    if calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls", f"must be a list, not {json_type(calls)}")
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, dict):
                raise RequestError(at, f"must be an object, not {json_type(call)}")
            unknown_fields(call, _CALL_FIELDS, at)
            if call.get("type", "function") != "function":
                raise RequestError(f"{at}.type", 'must be "function"')
            call_id = _optional_text(call, "id", at)
            name, arguments = _function(f"{at}.function", call.get("function"))
            out.append(ToolCall(call_id or f"call_{j}", name, arguments))
    if legacy is not None:
        name, arguments = _function(f"{where}.function_call", legacy)
        out.append(ToolCall(f"call_{len(out)}", name, arguments))
    return tuple(out)


def _function(where: str, function: object) -> tuple[str, str]:
    if not isinstance(function, dict):
        raise RequestError(where, f"must be an object, not {json_type(function)}")
    unknown_fields(function, _FUNCTION_FIELDS, where)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name", "must be a non-empty string")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        raise RequestError(f"{where}.arguments", f"must be a string, not {json_type(arguments)}")
    return text(f"{where}.name", name), text(f"{where}.arguments", arguments)


def _optional_text(obj: Mapping[str, object], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key}", f"must be a string, not {json_type(value)}")
    return text(f"{where}.{key}", value)


def _content(where: str, message: Mapping[str, object], separator: str, *, nullable: bool) -> str:
    """A string, or a list of text parts (an assistant's may also be refusal parts) joined
    into one string; null where `nullable` (an assistant's, a tool's)."""
    content = message.get("content")
    assistant = message.get("role") == "assistant"
    if isinstance(content, str):
        return text(where, content)
    if content is None and nullable:
        return ""
    if not isinstance(content, list):
        raise RequestError(
            where, f"must be a string or a list of text parts, not {json_type(content)}"
        )
    if not content:
        raise RequestError(where, "must not be an empty list")
    return separator.join(
        _part_text(f"{where}[{j}]", part, assistant) for j, part in enumerate(content)
    )


def _part_text(at: str, part: object, assistant: bool) -> str:
    if not isinstance(part, dict):
        raise RequestError(at, f"must be an object, not {json_type(part)}")
    kind = part.get("type")
    key, fields = "text", _TEXT_PART_FIELDS
    if kind == "refusal" and assistant:
        key, fields = "refusal", _REFUSAL_PART_FIELDS
    elif kind != "text":
        got = repr(kind) if isinstance(kind, str) else json_type(kind)
        raise RequestError(
            f"{at}.type", f'must be "text" (only text parts are supported), got {got}'
        )
    unknown_fields(part, fields, at)
    value = part.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{at}.{key}", f"must be a string, not {json_type(value)}")
    return text(f"{at}.{key}", value)
