"""The generation fields both endpoints share, parsed into a `Generation`: the sampling
parameters the engine runs with and what the answer carries. Pure.

    field                          how                                         see
    max_tokens                     new tokens per choice (completions:         chat: also
                                   default 16; chat: protocol.py's rule)       max_completion_tokens
    temperature top_p seed         as OpenAI; temperature defaults to 0        sampler.py
    top_k min_p                    vLLM extensions
    presence_penalty               [-2, 2], vLLM semantics                     sampler.py
    frequency_penalty
    repetition_penalty             (0, 2], vLLM extension
    logit_bias                     {"token id": bias in [-100, 100]}
    min_tokens ignore_eos          vLLM extensions: no stop before N tokens;
                                   EOS does not end generation
    stop stop_token_ids            up to 4 strings (or token ids); vLLM's ids
    n                              choices per prompt; choice i samples with seed + i
    stream stream_options          include_usage: a last chunk with the usage;
                                   continuous_usage_stats (vLLM): usage on every chunk
    return_token_ids               this server's: the choice's token ids
    include_stop_str_in_output     vLLM: the matched stop string stays in the text
    skip_special_tokens            vLLM: only true (the default) is supported
    response_format                text; json_object (any JSON object) and     grammar.py
                                   json_schema ({"name", "schema", "strict"}:
                                   always enforced) by constrained decoding;
                                   the answer ends ("stop") when the JSON does
    user                           accepted, unused

Logprobs and echo differ per endpoint; the endpoint's parser passes what it read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from dsv4_worker.engine.grammar import JSON_OBJECT, canonical_schema, schema_error
from dsv4_worker.engine.logprobs import MAX_TOP_LOGPROBS
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.fields import (
    MAX_SEED,
    RequestError,
    boolean,
    bounded_number,
    integer,
    is_int,
    json_type,
    number,
    optional_int,
    optional_object,
    optional_str,
    refuse_unless,
    text,
    token_id,
    unknown_fields,
)

MAX_STOP = 4
MAX_CHOICES = 128  # choices in one request (prompts x n), OpenAI's limit for n
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS = 100.0
DEFAULT_MAX_TOKENS = 16

GENERATION_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "n",
        "stream",
        "stream_options",
        "return_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "response_format",
        "user",
    }
)
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})


@dataclass(frozen=True, slots=True)
class Generation:
    params: SamplingParams  # choice i of a prompt samples with seed + i (`choice_params`)
    stop_strings: tuple[str, ...] = ()  # `stop` entries given as strings
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # alternatives listed per token; None: no logprobs
    echo: bool = False  # completions: the prompt (and its logprobs) lead each choice
    generate: bool = True  # False: echo with max_tokens 0 (the one token run is dropped)
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with the usage
    continuous_usage: bool = False  # streaming: the usage so far on every chunk
    return_token_ids: bool = False
    include_stop_str: bool = False  # a matched stop string stays in the text


@dataclass(frozen=True, slots=True)
class EndpointOptions:
    """What the endpoint's own fields ask (read by its parser)."""

    max_tokens: int | None  # chat: max_completion_tokens, else max_tokens; None: default
    logprobs: int | None  # alternatives per token (chat: top_logprobs when logprobs is true)
    echo: bool = False  # completions only


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice `index` of a prompt: the request's seed + index (vLLM), so
    n choices equal n single requests with those seeds."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1))


def parse_generation(
    obj: Mapping[str, object],
    options: EndpointOptions,
    prompt_lengths: tuple[int, ...],
    *,
    eos_ids: tuple[int, ...],
    vocab_size: int,
    max_context_tokens: int,
) -> Generation:
    echo = options.echo
    max_tokens = options.max_tokens
    generate = not (echo and max_tokens == 0)  # echo with nothing new: score the prompt
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    new_tokens = max(max_tokens, 1)  # echo without generation still computes one token
    _check_context(prompt_lengths, new_tokens, max_context_tokens)
    stop_strings, stop_ids = _parse_stop(obj.get("stop"), vocab_size)
    stop_ids = (*stop_ids, *_token_ids(obj, "stop_token_ids", vocab_size))
    if not boolean(obj, "ignore_eos"):
        stop_ids = (*stop_ids, *eos_ids)
    n = integer(obj, "n", 1, 1, MAX_CHOICES)
    if n * len(prompt_lengths) > MAX_CHOICES:
        raise RequestError("n", f"prompts x n must be at most {MAX_CHOICES}")
    min_tokens = integer(obj, "min_tokens", 0, 0, None)
    if min_tokens > max_tokens:
        raise RequestError("min_tokens", f"must be at most max_tokens ({max_tokens})")
    params = SamplingParams(
        max_new_tokens=new_tokens,
        temperature=number(obj, "temperature", 0.0, 0.0, MAX_TEMPERATURE),
        top_p=number(obj, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_top_k(obj),
        seed=optional_int(obj, "seed", 0, MAX_SEED),
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),  # the request's first, then EOS
        min_p=number(obj, "min_p", 0.0, 0.0, 1.0),
        min_tokens=min_tokens,
        presence_penalty=number(obj, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(obj, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=number(obj, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True),
        logit_bias=_logit_bias(obj, vocab_size),
        logprobs=options.logprobs,
        prompt_logprobs=options.logprobs if echo else None,
        json_schema=_response_format(obj),
    )
    stream = boolean(obj, "stream")
    stream_options = optional_object(obj, "stream_options") or {}
    unknown_fields(stream_options, _STREAM_OPTIONS, "stream_options")
    include_usage = boolean(stream_options, "include_usage")
    continuous = boolean(stream_options, "continuous_usage_stats")
    boolean(stream_options, "include_obfuscation")  # this server never pads chunks
    refuse_unless(
        obj,
        "skip_special_tokens",
        lambda v: v is True,
        "only true is supported: special tokens never appear in the text",
    )
    optional_str(obj, "user")  # accepted and unused
    return Generation(
        params=params,
        stop_strings=stop_strings,
        n=n,
        logprobs=options.logprobs,
        echo=echo,
        generate=generate,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=boolean(obj, "return_token_ids"),
        include_stop_str=boolean(obj, "include_stop_str_in_output"),
    )


def top_logprobs(where: str, obj: Mapping[str, object]) -> int | None:
    """A count of alternatives per token, [0, MAX_TOP_LOGPROBS]."""
    return optional_int(obj, where, 0, MAX_TOP_LOGPROBS)


def _check_context(prompt_lengths: tuple[int, ...], new_tokens: int, max_context: int) -> None:
    n = max(prompt_lengths)
    if n >= max_context:
        raise RequestError(
            "prompt",
            f"prompt ({n} tokens) leaves no room for new tokens in the maximum context "
            f"of {max_context} tokens",
        )
    if n + new_tokens > max_context:
        raise RequestError(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({new_tokens}) exceeds the maximum context "
            f"of {max_context} tokens",
        )


def _top_k(obj: Mapping[str, object]) -> int:
    """vLLM's top_k: -1 (or 0) is off."""
    value = obj.get("top_k")
    if value == -1 and is_int(value):
        return 0
    return integer(obj, "top_k", 0, 0, None)


def _logit_bias(obj: Mapping[str, object], vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = optional_object(obj, "logit_bias")
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        where = f"logit_bias.{key}"
        try:
            token = int(str(key))
        except ValueError:
            raise RequestError(where, "keys must be token ids (integers as strings)") from None
        token_id(where, token, vocab_size)
        out.append((token, bounded_number(where, value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
    return tuple(sorted(out))


def _token_ids(obj: Mapping[str, object], key: str, vocab_size: int) -> tuple[int, ...]:
    value = obj.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError(key, f"must be a list of token ids, not {json_type(value)}")
    return tuple(token_id(f"{key}[{i}]", v, vocab_size) for i, v in enumerate(value))


def _parse_stop(stop: object, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise RequestError("stop", f"must be a string or a list, not {json_type(stop)}")
    if len(items) > MAX_STOP:
        raise RequestError("stop", f"at most {MAX_STOP} entries, got {len(items)}")
    strings: list[str] = []
    ids: list[int] = []
    for i, item in enumerate(items):
        where = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if isinstance(item, str):
            if not item:
                raise RequestError(where, "must not be empty")
            strings.append(text(where, item))
        elif is_int(item):
            ids.append(token_id(where, item, vocab_size))
        else:
            raise RequestError(where, f"must be a string or a token id, not {json_type(item)}")
    return tuple(strings), tuple(ids)


_JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})


def _response_format(obj: Mapping[str, object]) -> str | None:
    """The JSON schema (text) the output must match; None for plain text."""
    fmt = optional_object(obj, "response_format")
    if fmt is None:
        return None
    unknown_fields(fmt, frozenset({"type", "json_schema"}), "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return enforceable("response_format", JSON_OBJECT)
    if kind != "json_schema":
        raise RequestError(
            "response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'
        )
    where = "response_format.json_schema"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(where, f"must be an object, not {json_type(spec)}")
    unknown_fields(spec, _JSON_SCHEMA_FIELDS, where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name", "must be a non-empty string")
    for key, kind, label in (("description", str, "string"), ("strict", bool, "boolean")):
        value = spec.get(key)  # strict or not, the schema is enforced
        if value is not None and not isinstance(value, kind):
            raise RequestError(f"{where}.{key}", f"must be a {label}, not {json_type(value)}")
    schema = spec.get("schema")
    if schema is None:
        return enforceable(where, JSON_OBJECT)  # OpenAI: without a schema, any JSON object
    if not isinstance(schema, dict):
        raise RequestError(f"{where}.schema", f"must be an object, not {json_type(schema)}")
    return enforceable(f"{where}.schema", canonical_schema(schema))


def enforceable(where: str, schema: str) -> str:
    """`schema` (a JSON schema or a Lark grammar) when the grammar library compiles it, else a
    400 naming `where`."""
    try:
        why = schema_error(schema)
    except RuntimeError as exc:  # the library is missing (it comes with the worker extra)
        raise RequestError(where, str(exc)) from None
    if why is not None:
        raise RequestError(where, f"not a grammar this server can enforce: {why}")
    return schema
