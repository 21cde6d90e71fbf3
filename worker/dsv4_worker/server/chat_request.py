"""The chat-only fields of /v1/chat/completions: the messages (rendered by the tokenizer's chat
template) and the fields no completion has. Pure.

    messages        roles system, developer (rendered as system), user, assistant; content a
                    string or a list of text parts (joined with "\\n"); `name` is passed to
                    the template. Refused: image, audio and file parts; tool and function
                    messages and assistant tool calls (no tool parser)
    logprobs top_logprobs          honored: each token's logprob and up to 20 alternatives
    max_completion_tokens          honored (wins over max_tokens)
    tools functions                [] accepted; a tool list only with tool_choice "none"
    tool_choice function_call      "none" (or "auto" without tools) accepted
    audio modalities moderation    only null / ["text"]: text in, text out, no moderation
    web_search_options             only null: no web search
    reasoning_effort verbosity     only null / "none" / "medium": no reasoning controls
    store                          only false / null: nothing is stored
    metadata parallel_tool_calls   accepted, unused
    prediction prompt_cache_*      accepted, unused (hints that change no output)
    safety_identifier service_tier accepted, unused
"""

from __future__ import annotations

from collections.abc import Mapping

from dsv4_worker.server.fields import (
    RequestError,
    boolean,
    json_type,
    one_of,
    optional_object,
    optional_str,
    refuse_unless,
    text,
    unknown_fields,
)
from dsv4_worker.server.generation import EndpointOptions, top_logprobs

CHAT_FIELDS = frozenset(
    {
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "audio",
        "function_call",
        "functions",
        "metadata",
        "modalities",
        "moderation",
        "parallel_tool_calls",
        "prediction",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "safety_identifier",
        "service_tier",
        "store",
        "tool_choice",
        "tools",
        "verbosity",
        "web_search_options",
    }
)
CHAT_ROLES = ("system", "developer", "user", "assistant")
TOOL_ROLES = ("tool", "function")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"}
)
_TEXT_PART_FIELDS = frozenset({"type", "text", "prompt_cache_breakpoint"})
_REFUSAL_PART_FIELDS = frozenset({"type", "refusal"})
PART_SEPARATOR = "\n"  # between the text parts of one message
NO_TOOLS = "tool calling is not supported (this server has no tool parser)"


def chat_options(obj: Mapping[str, object], max_tokens: int | None) -> EndpointOptions:
    """Check the chat-only fields; the logprobs and length they ask for."""
    wants_logprobs = boolean(obj, "logprobs")
    top = top_logprobs("top_logprobs", obj)
    if top and not wants_logprobs:
        raise RequestError("top_logprobs", "needs logprobs: true")
    _check_tools(obj)
    refuse_unless(obj, "audio", lambda _: False, "audio output is not supported")
    refuse_unless(
        obj, "modalities", lambda v: v == ["text"], 'only ["text"] is supported (no audio)'
    )
    refuse_unless(obj, "moderation", lambda _: False, "moderation is not supported")
    refuse_unless(obj, "web_search_options", lambda _: False, "web search is not supported")
    refuse_unless(obj, "reasoning_effort", lambda v: v == "none", 'only "none" is supported')
    refuse_unless(obj, "verbosity", lambda v: v == "medium", 'only "medium" is supported')
    refuse_unless(obj, "store", lambda v: v is False, "only false is supported: nothing is stored")
    optional_object(obj, "metadata")
    optional_object(obj, "prediction")
    optional_object(obj, "prompt_cache_options")
    boolean(obj, "parallel_tool_calls")
    for key in ("prompt_cache_key", "prompt_cache_retention", "safety_identifier"):
        optional_str(obj, key)
    one_of(obj, "service_tier", SERVICE_TIERS)
    return EndpointOptions(max_tokens=max_tokens, logprobs=(top or 0) if wants_logprobs else None)


def _check_tools(obj: Mapping[str, object]) -> None:
    """Tools are accepted only where they cannot be called: none given, or choice "none"."""
    for tools_key, choice_key in (("tools", "tool_choice"), ("functions", "function_call")):
        tools = obj.get(tools_key)
        if tools is not None and not isinstance(tools, list):
            raise RequestError(tools_key, f"must be a list, not {json_type(tools)}")
        choice = obj.get(choice_key)
        if choice == "none" or (not tools and choice in (None, "auto")):
            continue  # nothing can be called
        if tools and choice in (None, "auto"):
            raise RequestError(tools_key, f'{NO_TOOLS}; send {choice_key}: "none" or no tools')
        raise RequestError(choice_key, f'{NO_TOOLS}; only "none" is accepted')


def parse_messages(obj: Mapping[str, object]) -> list[dict[str, str]]:
    if "messages" not in obj:
        raise RequestError("messages", "is required")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise RequestError("messages", f"must be a list of objects, not {json_type(messages)}")
    if not messages:
        raise RequestError("messages", "must not be empty")
    return [_parse_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _parse_message(where: str, message: object) -> dict[str, str]:
    if not isinstance(message, dict):
        raise RequestError(where, f"must be an object, not {json_type(message)}")
    unknown_fields(message, _MESSAGE_FIELDS, where)
    role = message.get("role")
    if role in TOOL_ROLES:
        raise RequestError(f"{where}.role", f"{role} messages are refused: {NO_TOOLS}")
    if role not in CHAT_ROLES:
        raise RequestError(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}")
    assistant = role == "assistant"
    if assistant:
        refuse_unless(message, "tool_calls", lambda v: v == [], NO_TOOLS, where)
        refuse_unless(message, "function_call", lambda _: False, NO_TOOLS, where)
        refuse_unless(message, "audio", lambda _: False, "audio is not supported", where)
        optional_str(message, "refusal")
    else:
        for key in ("tool_calls", "function_call", "refusal", "audio", "tool_call_id"):
            if key in message:
                raise RequestError(f"{where}.{key}", f"is not a field of a {role} message")
    out = {
        "role": "system" if role == "developer" else str(role),
        "content": _parse_content(f"{where}.content", message, assistant),
    }
    name = optional_str(message, "name")
    if name is not None:
        out["name"] = name
    return out


def _parse_content(where: str, message: Mapping[str, object], assistant: bool) -> str:
    """A string, or a list of text parts (an assistant's may also be refusal parts) joined
    into one string; an assistant's may be null."""
    content = message.get("content")
    if isinstance(content, str):
        return text(where, content)
    if content is None and assistant:
        return ""
    if not isinstance(content, list):
        raise RequestError(
            where, f"must be a string or a list of text parts, not {json_type(content)}"
        )
    if not content:
        raise RequestError(where, "must not be an empty list")
    return PART_SEPARATOR.join(
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
