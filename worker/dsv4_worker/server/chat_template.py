"""A HuggingFace chat template: compiled once in jinja2's immutable sandbox, rendered per request
with what HF templates expect. Pure: no files (`tokenizer_config.py` finds the text).

    name                   what a template sees
    messages               [{"role", "content"}] with content a string, and OpenAI's
                           tool_calls / tool_call_id / name / reasoning_content where given
    add_generation_prompt  True when serving: the template opens the assistant's turn
    bos_token, eos_token   (and unk/pad/... when the config sets them) token strings
    tools                  the request's tools in OpenAI's shape, else None
    documents              None (RAG documents are not supported)
    thinking,              the request's thinking mode (DeepSeek's and Qwen's names),
    enable_thinking        and every other chat_template_kwargs entry
    raise_exception(msg)   refuses the conversation (the client gets a 400 on `messages`)
    strftime_now(fmt)      the local time, formatted
    |tojson                JSON without HTML escaping, non-ASCII kept (not jinja's own tojson)

The environment is HF's: trim_blocks, lstrip_blocks, loop controls, and the
`{% generation %}` tag (rendered as its body).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """These messages cannot be rendered: the template refused them or failed on them."""


class _Refused(Exception):
    """`raise_exception` was called by the template."""


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    def __init__(
        self, source: str, *, origin: str, special_tokens: Mapping[str, str] | None = None
    ) -> None:
        """Compile `source`; a template that does not compile is a ValueError naming
        `origin` (the file, or the config key, it came from)."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as exc:
            raise ValueError(
                f"{origin}: the chat template does not compile: {exc.message} (line {exc.lineno})"
            ) from exc
        except TemplateError as exc:
            raise ValueError(f"{origin}: the chat template does not compile: {exc}") from exc
        self.source = source
        self.origin = origin
        self.special_tokens: dict[str, str] = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text for `messages`; ChatTemplateError when the template refuses them
        or fails on them. `extra`: more variables (chat_template_kwargs), which may not
        replace the ones above."""
        variables: dict[str, object] = {
            **self.special_tokens,
            **(extra or {}),
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": [dict(t) for t in tools] if tools else None,
            "documents": None,
        }
        # NOTE: the template is data from the model directory: any exception it raises while
        # rendering means these messages cannot be rendered, never that the server is broken.
        try:
            return self._template.render(variables)
        except _Refused as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from exc
        except Exception as exc:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks the assistant's part with it (for
    training masks); serving renders the body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise _Refused(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
