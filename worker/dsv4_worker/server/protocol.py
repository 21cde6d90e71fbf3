"""Parsing and validation of OpenAI-compatible request bodies (completions and chat) into a
`CompletionRequest`. Pure: no I/O; every bad field raises `RequestError` (HTTP 400 naming
the field; 404 `model_not_found` for a model this server does not serve).

Every field of the current OpenAI API is accepted; what this server does with each is in
`generation.py` (the shared sampling fields) and `chat_request.py` (messages and the chat-only
fields). Completions add:

    prompt     a string, a list of token ids, or a list of either (a batch: each prompt gets
               `n` choices, choice index = prompt index x n + i)
    echo       the prompt leads each choice's text (and its logprobs, when asked)
    logprobs   0-20: each token's logprob and that many alternatives (OpenAI's legacy form)
    max_tokens 0 only with echo: the prompt and its logprobs alone (scoring)
    best_of    only null or n: no ranking of extra candidates
    suffix     only null or "": no fill-in-the-middle

Differences from OpenAI: `temperature` defaults to 0 (greedy), not 1; a chat request without
max_tokens may use what the context leaves (vLLM's rule; `ApiOptions.max_tokens_default`
caps it), a completion's defaults to 16 (OpenAI's and vLLM's); `stop` may also hold token
ids; an explicit null for an optional field means its default. The tokenizer's EOS ids join
the request's stop ids (unless `ignore_eos`), so generation ends at EOS (finish_reason "stop").
An unknown top-level field is ignored and listed in `CompletionRequest.ignored` (a 400 with
`ApiOptions.strict_fields`); an unknown field inside an object is always a 400.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from dsv4_worker.engine.logprobs import MAX_TOP_LOGPROBS
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.api_options import ApiOptions
from dsv4_worker.server.chat_messages import parse_messages
from dsv4_worker.server.chat_reply import ReplySpec
from dsv4_worker.server.chat_request import CHAT_FIELDS, ChatSpec, chat_options, chat_spec
from dsv4_worker.server.chat_template import ChatTemplateError
from dsv4_worker.server.conversation import Conversation, opens_reasoning
from dsv4_worker.server.fields import (
    RequestError,
    boolean,
    extra_fields,
    integer,
    is_int,
    json_type,
    refuse_unless,
    text,
    token_id,
    unknown_fields,
)
from dsv4_worker.server.generation import (
    GENERATION_FIELDS,
    EndpointOptions,
    Generation,
    enforceable,
    parse_generation,
)
from dsv4_worker.server.tokenizer import Tokenizer
from dsv4_worker.server.tool_grammar import reasoning_then_json, tools_grammar

__all__ = ["CompletionRequest", "Prompt", "RequestError", "parse_chat", "parse_completion"]

COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "echo", "logprobs", "best_of", "suffix", *GENERATION_FIELDS}
)
ALL_CHAT_FIELDS = frozenset({"model", "messages", *CHAT_FIELDS, *GENERATION_FIELDS})
DEFAULT_API = ApiOptions()


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: tuple[int, ...]  # the tokenized prompt
    text: str  # the prompt as text (decoded when ids were given)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]  # chat: one; completions: one or a batch
    gen: Generation
    model: str | None  # the served model it named (None: not named)
    reply: ReplySpec | None = None  # chat: how its text splits into reasoning, content, calls
    ignored: tuple[str, ...] = ()  # unknown top-level fields, not acted on

    @property
    def params(self) -> SamplingParams:
        return self.gen.params

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.gen.stop_strings

    @property
    def stream(self) -> bool:
        return self.gen.stream

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The first prompt's tokens."""
        return self.prompts[0].ids

    @property
    def echo_prompt_text(self) -> str:
        """The first prompt's text."""
        return self.prompts[0].text


def parse_completion(
    body: object,
    tok: Tokenizer,
    *,
    vocab_size: int,
    max_context_tokens: int,
    models: tuple[str, ...] = (),
    options: ApiOptions = DEFAULT_API,
) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest. `models`: the names this server serves
    (empty: any name)."""
    obj, ignored = _as_object(body, COMPLETION_FIELDS, options.strict_fields)
    model = _model(obj, models)
    prompts = _parse_prompts(obj, tok, vocab_size)
    echo = boolean(obj, "echo")
    endpoint = EndpointOptions(
        max_tokens=_max_tokens(obj, "max_tokens", max_context_tokens, allow_zero=echo),
        logprobs=_completion_logprobs(obj),
        echo=echo,
    )
    gen = parse_generation(
        obj,
        endpoint,
        tuple(len(p.ids) for p in prompts),
        eos_ids=tok.eos_token_ids,
        vocab_size=vocab_size,
        max_context_tokens=max_context_tokens,
    )
    best_of = obj.get("best_of")
    if best_of is not None and not (is_int(best_of) and best_of == gen.n):
        raise RequestError(
            "best_of", f"only null or n ({gen.n}) is supported: candidates are never ranked"
        )
    refuse_unless(obj, "suffix", lambda v: v == "", "is not supported (no fill-in-the-middle)")
    return CompletionRequest(prompts, gen, model, ignored=ignored)


def parse_chat(
    body: object,
    tok: Tokenizer,
    *,
    vocab_size: int,
    max_context_tokens: int,
    models: tuple[str, ...] = (),
    options: ApiOptions = DEFAULT_API,
) -> CompletionRequest:
    """A /v1/chat/completions body -> CompletionRequest (messages rendered and tokenized by
    the tokenizer: its chat template, or DeepSeek-V4's encoding)."""
    obj, ignored = _as_object(body, ALL_CHAT_FIELDS, options.strict_fields)
    model = _model(obj, models)
    messages = parse_messages(obj)
    spec = chat_spec(obj, options.thinking_default)
    max_field = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else None
    max_tokens = _max_tokens(obj, max_field or "max_tokens", max_context_tokens, allow_zero=False)
    endpoint = chat_options(obj, max_tokens)
    conv = Conversation(
        messages, spec.tools.shown, spec.thinking, spec.effort, spec.template_kwargs
    )
    try:
        prompt = tok.encode_chat(conv)
    except ChatTemplateError as exc:
        raise RequestError("messages", str(exc)) from exc
    if max_tokens is None:  # what the context leaves (at least 1: a full prompt is refused)
        left = max(max_context_tokens - len(prompt.ids), 1)
        cap = options.max_tokens_default
        endpoint = dataclasses.replace(endpoint, max_tokens=min(left, cap) if cap else left)
    gen = parse_generation(
        obj,
        endpoint,
        (len(prompt.ids),),
        eos_ids=tok.eos_token_ids,
        vocab_size=vocab_size,
        max_context_tokens=max_context_tokens,
    )
    reasoning = opens_reasoning(prompt.text)
    gen = _chat_grammar(gen, spec, reasoning)
    reply = ReplySpec(
        reasoning=reasoning,
        callable=spec.tools.callable,
        parallel=spec.tools.choice.parallel,
    )
    return CompletionRequest((Prompt(prompt.ids, prompt.text),), gen, model, reply, ignored)


def _chat_grammar(gen: Generation, spec: ChatSpec, reasoning: bool) -> Generation:
    """The request's grammar: tool calls for tool_choice "required" or a named tool; a
    response_format's JSON after the reasoning when the reply opens with it."""
    tools, schema = spec.tools, gen.params.json_schema
    if tools.choice.constrained:
        if schema is not None:
            raise RequestError(
                "response_format",
                'cannot be combined with tool_choice "required" or a named tool: the reply '
                "is tool calls",
            )
        grammar = tools_grammar(tools.specs, tools.choice, thinking=reasoning, where=tools.key)
        schema = enforceable(tools.key, grammar)
    elif schema is not None and reasoning:
        schema = enforceable("response_format", reasoning_then_json(schema))
    else:
        return gen
    return dataclasses.replace(gen, params=dataclasses.replace(gen.params, json_schema=schema))


# ---- the body, the model and the prompt ------------------------------------------------------


def _as_object(
    body: object, allowed: frozenset[str], strict: bool
) -> tuple[Mapping[str, object], tuple[str, ...]]:
    """The body and the unknown top-level fields it has (a 400 when `strict`)."""
    if not isinstance(body, dict):
        raise RequestError("", f"the body must be a JSON object, not {json_type(body)}")
    if strict:
        unknown_fields(body, allowed)
    ignored = extra_fields(body, allowed)
    return {k: v for k, v in body.items() if k in allowed} if ignored else body, ignored


def _model(obj: Mapping[str, object], models: tuple[str, ...]) -> str | None:
    """The model the body names: null or absent means the served one (as vLLM does)."""
    model = obj.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise RequestError("model", f"must be a string, not {json_type(model)}")
    if models and model not in models:
        shown = model.encode("unicode_escape").decode()[:200]
        raise RequestError(
            "model",
            f"the model `{shown}` does not exist; this server serves {', '.join(models)}",
            status=404,
            code="model_not_found",
        )
    return model


def _max_tokens(
    obj: Mapping[str, object], key: str, max_context_tokens: int, *, allow_zero: bool
) -> int | None:
    if obj.get(key) is None:
        return None
    return integer(obj, key, 0, 0 if allow_zero else 1, max_context_tokens)


def _completion_logprobs(obj: Mapping[str, object]) -> int | None:
    value = obj.get("logprobs")
    if value is None:
        return None
    return integer(obj, "logprobs", 0, 0, MAX_TOP_LOGPROBS)


def _parse_prompts(
    obj: Mapping[str, object], tok: Tokenizer, vocab_size: int
) -> tuple[Prompt, ...]:
    if "prompt" not in obj:
        raise RequestError("prompt", "is required")
    prompt = obj["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_int(prompt[0])):
        return (_one_prompt("prompt", prompt, tok, vocab_size),)
    if not isinstance(prompt, list):
        raise RequestError(
            "prompt",
            f"must be a string, a list of token ids or a list of either, not {json_type(prompt)}",
        )
    if not prompt:
        raise RequestError("prompt", "must not be empty")
    return tuple(_one_prompt(f"prompt[{i}]", p, tok, vocab_size) for i, p in enumerate(prompt))


def _one_prompt(where: str, prompt: object, tok: Tokenizer, vocab_size: int) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(where, "must not be empty")
        return Prompt(tuple(tok.encode(text(where, prompt))), prompt)
    if not isinstance(prompt, list):
        raise RequestError(
            where, f"must be a string or a list of token ids, not {json_type(prompt)}"
        )
    if not prompt:
        raise RequestError(where, "must not be empty")
    ids = tuple(token_id(f"{where}[{i}]", v, vocab_size) for i, v in enumerate(prompt))
    return Prompt(ids, tok.decode(ids))
