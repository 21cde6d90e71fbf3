"""One chat choice's reply as OpenAI shows it: the model's text split by `ReplyParser` into
reasoning_content, content and tool calls, with the request's tool rules applied. Pure.

    a call to a tool the request does not offer (or any call with tool_choice "none",
    or with no tools)                                  dropped (and never shown as content)
    parallel_tool_calls false                          only the first call is kept
    ids                                                call_<24 hex>, new per call
    finish_reason                                      "tool_calls" when the reply has calls
                                                       and ended by itself ("stop")
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsv4_worker.server.reply_parser import Parsed, ParsedCall, ReplyParser

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplySpec:
    """What a chat request decides about its replies."""

    reasoning: bool = False  # the prompt opened the reasoning (it ends with <think>)
    callable: frozenset[str] = frozenset()  # tool names a call may have
    parallel: bool = True  # more than one call per reply


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    index: int
    id: str
    name: str
    arguments: str

    def as_openai(self, *, with_index: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"index": self.index, **out} if with_index else out


@dataclass(slots=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)


class ChatReply:
    def __init__(self, spec: ReplySpec) -> None:
        self.spec = spec
        self._parser = ReplyParser(reasoning=spec.reasoning)
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCallOut] = []
        self._pending = Delta()
        self.dropped = 0  # calls not shown (not offered, or past the first)

    def push(self, text: str) -> None:
        if text:
            self._take(self._parser.push(text))

    def finish(self) -> None:
        self._take(self._parser.finish())

    def take_delta(self) -> Delta:
        """What was released since the last call."""
        delta, self._pending = self._pending, Delta()
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason == "stop" and self.calls:
            return "tool_calls"
        return engine_reason

    def _take(self, parsed: Parsed) -> None:
        self.reasoning += parsed.reasoning
        self.content += parsed.content
        self._pending.reasoning += parsed.reasoning
        self._pending.content += parsed.content
        for call in parsed.calls:
            self._call(call)

    def _call(self, call: ParsedCall) -> None:
        if call.name not in self.spec.callable or (self.calls and not self.spec.parallel):
            self.dropped += 1
            log.info("a tool call to %r was dropped (not offered, or not the first)", call.name)
            return
        out = ToolCallOut(
            len(self.calls), f"call_{uuid.uuid4().hex[:24]}", call.name, call.arguments
        )
        self.calls.append(out)
        self._pending.calls.append(out)
