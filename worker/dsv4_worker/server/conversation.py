"""What a chat request asks the prompt to be (`Conversation`) and how it becomes text: a model
directory's own chat template when it has one, else DeepSeek-V4's encoding. Pure.

`opens_reasoning` tells the reply parser where the model's text starts: a prompt that ends
with <think> (whitespace aside) has opened the reasoning, whoever rendered it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from dsv4_worker.server.chat_messages import Message
from dsv4_worker.server.chat_template import ChatTemplate
from dsv4_worker.server.dsml import THINK_START
from dsv4_worker.server.dsv4_encoding import Effort, encode
from dsv4_worker.server.tools import ToolSpec

# Variables a template gets from the server; chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARS: Final = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents"}
)


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()  # the tools the prompt shows
    thinking: bool = False
    effort: Effort | None = None
    template_kwargs: Mapping[str, object] = field(default_factory=dict)


def render(conv: Conversation, template: ChatTemplate | None) -> str:
    """The prompt text (a ChatTemplateError when the directory's template refuses it)."""
    if template is None:
        return encode(conv.messages, conv.tools, thinking=conv.thinking, effort=conv.effort)
    tools = [{"type": "function", "function": dict(t.function)} for t in conv.tools]
    extra = {
        **conv.template_kwargs,
        "thinking": conv.thinking,
        "enable_thinking": conv.thinking,
    }
    if conv.effort is not None:
        extra["reasoning_effort"] = conv.effort
    return template.render(
        [m.as_template_dict() for m in conv.messages], tools=tools or None, extra=extra
    )


def opens_reasoning(prompt: str) -> bool:
    return prompt.rstrip().endswith(THINK_START)
