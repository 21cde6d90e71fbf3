"""The chat-only fields of /v1/chat/completions: what the prompt is (`ChatSpec`: the tools,
the thinking mode, the template's kwargs) and the fields no completion has. Pure. The messages
are `chat_messages.py`'s, the tools `tools.py`'s.

    tools tool_choice              honored (tools.py); functions / function_call: the legacy
    parallel_tool_calls            names of the same
    thinking                       DeepSeek's {"type": "enabled" | "disabled"}
    chat_template_kwargs           {"thinking": bool} (vLLM's and SGLang's switch; also
                                   "enable_thinking"); every entry reaches a model
                                   directory's own template
    reasoning_effort               "none": thinking off; minimal/low, medium/high, xhigh/max:
                                   DeepSeek's three efforts, thinking on unless a switch
                                   above turns it off ("max" adds the release's instruction)
    logprobs top_logprobs          honored: each token's logprob and up to 20 alternatives
    max_completion_tokens          honored (wins over max_tokens)
    audio modalities moderation    only null / ["text"]: text in, text out, no moderation
    web_search_options             only null: no web search
    verbosity                      only null / "medium"
    store                          only false / null: nothing is stored
    metadata                       accepted, unused
    prediction prompt_cache_*      accepted, unused (hints that change no output)
    safety_identifier service_tier accepted, unused

Two switches that disagree (thinking enabled, chat_template_kwargs.thinking false) are a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dsv4_worker.server.conversation import RESERVED_TEMPLATE_VARS
from dsv4_worker.server.dsv4_encoding import Effort
from dsv4_worker.server.fields import (
    RequestError,
    boolean,
    json_type,
    one_of,
    optional_object,
    optional_str,
    refuse_unless,
    unknown_fields,
)
from dsv4_worker.server.generation import EndpointOptions, top_logprobs
from dsv4_worker.server.tools import Tools, parse_tools

CHAT_FIELDS = frozenset(
    {
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "audio",
        "chat_template_kwargs",
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
        "thinking",
        "tool_choice",
        "tools",
        "verbosity",
        "web_search_options",
    }
)
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
EFFORTS: dict[str, Effort | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}


@dataclass(frozen=True, slots=True)
class ChatSpec:
    tools: Tools = field(default_factory=Tools)
    thinking: bool = False
    effort: Effort | None = None
    template_kwargs: Mapping[str, object] = field(default_factory=dict)


def chat_spec(obj: Mapping[str, object], thinking_default: bool) -> ChatSpec:
    """The tools, the thinking mode (`thinking_default` when nothing chooses) and the
    template's kwargs."""
    kwargs = dict(optional_object(obj, "chat_template_kwargs") or {})
    for key in sorted(kwargs):
        if key in RESERVED_TEMPLATE_VARS:
            raise RequestError(f"chat_template_kwargs.{key}", "is set by the server")
    switches: list[tuple[str, bool]] = []
    for key in ("thinking", "enable_thinking"):
        if kwargs.get(key) is not None:
            switches.append((f"chat_template_kwargs.{key}", _bool(kwargs, key)))
    deepseek = optional_object(obj, "thinking")
    if deepseek is not None:
        unknown_fields(deepseek, frozenset({"type"}), "thinking")
        kind = deepseek.get("type")
        if kind not in ("enabled", "disabled"):
            raise RequestError("thinking.type", f'must be "enabled" or "disabled", got {kind!r}')
        switches.append(("thinking.type", kind == "enabled"))
    effort_name = one_of(obj, "reasoning_effort", tuple(EFFORTS))
    effort = EFFORTS[effort_name] if effort_name is not None else None
    if effort_name == "none":
        switches.append(("reasoning_effort", False))
    for where, value in switches[1:]:
        if value != switches[0][1]:
            raise RequestError(where, f"disagrees with {switches[0][0]}")
    thinking = switches[0][1] if switches else thinking_default or effort is not None
    kwargs.pop("thinking", None)
    kwargs.pop("enable_thinking", None)
    return ChatSpec(parse_tools(obj), thinking, effort if thinking else None, kwargs)


def chat_options(obj: Mapping[str, object], max_tokens: int | None) -> EndpointOptions:
    """Check the chat-only fields; the logprobs and length they ask for."""
    wants_logprobs = boolean(obj, "logprobs")
    top = top_logprobs("top_logprobs", obj)
    if top and not wants_logprobs:
        raise RequestError("top_logprobs", "needs logprobs: true")
    refuse_unless(obj, "audio", lambda _: False, "audio output is not supported")
    refuse_unless(
        obj, "modalities", lambda v: v == ["text"], 'only ["text"] is supported (no audio)'
    )
    refuse_unless(obj, "moderation", lambda _: False, "moderation is not supported")
    refuse_unless(obj, "web_search_options", lambda _: False, "web search is not supported")
    refuse_unless(obj, "verbosity", lambda v: v == "medium", 'only "medium" is supported')
    refuse_unless(obj, "store", lambda v: v is False, "only false is supported: nothing is stored")
    optional_object(obj, "metadata")
    optional_object(obj, "prediction")
    optional_object(obj, "prompt_cache_options")
    for key in ("prompt_cache_key", "prompt_cache_retention", "safety_identifier"):
        optional_str(obj, key)
    one_of(obj, "service_tier", SERVICE_TIERS)
    return EndpointOptions(max_tokens=max_tokens, logprobs=(top or 0) if wants_logprobs else None)


def _bool(obj: Mapping[str, object], key: str) -> bool:
    value = obj.get(key)
    if not isinstance(value, bool):
        raise RequestError(
            f"chat_template_kwargs.{key}", f"must be a boolean, not {json_type(value)}"
        )
    return value
