"""Parsing and validation of OpenAI-compatible request bodies (completions and chat) into a
`CompletionRequest`. Pure: no I/O; every bad field raises `RequestError` (HTTP 400).

Differences from OpenAI: `temperature` defaults to 0 (greedy), not 1; `n` must be 1;
`stop` may also hold token ids; an explicit null for an optional field means its default.
A chat message's content is a string or a list of text parts (joined with "\n"); other
parts (image_url, ...) are refused. The tokenizer's EOS ids join the request's stop ids, so
generation ends at EOS (finish_reason "stop").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.chat_template import ChatTemplateError
from dsv4_worker.server.tokenizer import Tokenizer

MAX_STOP = 4
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
CHAT_ROLES = ("system", "user", "assistant")

_COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "return_token_ids",
    "n",
    "user",
)
COMPLETION_FIELDS = ("prompt", *_COMMON_FIELDS)
CHAT_FIELDS = ("messages", *_COMMON_FIELDS)
_MESSAGE_FIELDS = ("role", "content")
_PART_FIELDS = ("type", "text")
PART_SEPARATOR = "\n"  # between the text parts of one message


class RequestError(ValueError):
    """A client error (HTTP 400); `field` names the JSON field ("" for the whole body)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt_ids: tuple[int, ...]  # the tokenized prompt
    params: SamplingParams
    stop_strings: tuple[str, ...]  # `stop` entries given as strings
    stream: bool
    return_token_ids: bool
    model: str | None
    echo_prompt_text: str  # the prompt as text (decoded when ids were given)


def parse_completion(
    body: object, tok: Tokenizer, *, vocab_size: int, max_context_tokens: int
) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest."""
    obj = _as_object(body, COMPLETION_FIELDS)
    ids, text = _parse_prompt(obj, tok, vocab_size)
    return _finish(obj, ids, text, tok.eos_token_ids, vocab_size, max_context_tokens)


def parse_chat(
    body: object, tok: Tokenizer, *, vocab_size: int, max_context_tokens: int
) -> CompletionRequest:
    """A /v1/chat/completions body -> CompletionRequest (messages rendered and tokenized by
    the tokenizer: its chat template, or the built-in one)."""
    obj = _as_object(body, CHAT_FIELDS)
    try:
        prompt = tok.encode_chat(_parse_messages(obj))
    except ChatTemplateError as exc:
        raise RequestError("messages", str(exc)) from exc
    return _finish(obj, prompt.ids, prompt.text, tok.eos_token_ids, vocab_size, max_context_tokens)


# ---- the body and the prompt -----------------------------------------------------------------


def _as_object(body: object, allowed: Sequence[str]) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise RequestError("", f"the body must be a JSON object, not {_json_type(body)}")
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise RequestError(
            unknown[0], f"unknown field; allowed fields are {', '.join(sorted(allowed))}"
        )
    return body


def _parse_prompt(
    obj: Mapping[str, object], tok: Tokenizer, vocab_size: int
) -> tuple[tuple[int, ...], str]:
    if "prompt" not in obj:
        raise RequestError("prompt", "is required")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "must not be empty")
        return tuple(tok.encode(prompt)), prompt
    if not isinstance(prompt, list):
        raise RequestError(
            "prompt", f"must be a string or a list of token ids, not {_json_type(prompt)}"
        )
    if not prompt:
        raise RequestError("prompt", "must not be empty")
    ids = tuple(_token_id(f"prompt[{i}]", v, vocab_size) for i, v in enumerate(prompt))
    return ids, tok.decode(ids)


def _parse_messages(obj: Mapping[str, object]) -> list[dict[str, str]]:
    if "messages" not in obj:
        raise RequestError("messages", "is required")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise RequestError("messages", f"must be a list of objects, not {_json_type(messages)}")
    if not messages:
        raise RequestError("messages", "must not be empty")
    return [_parse_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _parse_message(where: str, message: object) -> dict[str, str]:
    if not isinstance(message, dict):
        raise RequestError(where, f"must be an object, not {_json_type(message)}")
    unknown = sorted(str(k) for k in message if k not in _MESSAGE_FIELDS)
    if unknown:
        raise RequestError(f"{where}.{unknown[0]}", "unknown field; allowed are role, content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}")
    return {"role": str(role), "content": _parse_content(f"{where}.content", message)}


def _parse_content(where: str, message: Mapping[str, object]) -> str:
    """A string, or a list of {"type": "text", "text": ...} parts joined into one string."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            where, f"must be a string or a list of text parts, not {_json_type(content)}"
        )
    if not content:
        raise RequestError(where, "must not be an empty list")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(at, f"must be an object, not {_json_type(part)}")
        kind = part.get("type")
        if kind != "text":
            got = repr(kind) if isinstance(kind, str) else _json_type(kind)
            raise RequestError(
                f"{at}.type", f'must be "text" (only text parts are supported), got {got}'
            )
        unknown = sorted(str(k) for k in part if k not in _PART_FIELDS)
        if unknown:
            raise RequestError(f"{at}.{unknown[0]}", "unknown field; allowed are type, text")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{at}.text", f"must be a string, not {_json_type(text)}")
        texts.append(text)
    return PART_SEPARATOR.join(texts)


# ---- sampling fields and the context check ---------------------------------------------------


def _finish(
    obj: Mapping[str, object],
    prompt_ids: tuple[int, ...],
    prompt_text: str,
    eos_ids: tuple[int, ...],
    vocab_size: int,
    max_context_tokens: int,
) -> CompletionRequest:
    max_tokens = _int(obj, "max_tokens", 16, 1, max_context_tokens)
    stop_strings, stop_ids = _parse_stop(obj.get("stop"), vocab_size)
    stop_ids = tuple(dict.fromkeys((*stop_ids, *eos_ids)))  # the request's first, then EOS
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_float(obj, "temperature", 0.0, 0.0, MAX_TEMPERATURE, low_open=False),
        top_p=_float(obj, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_int(obj, "top_k", 0, 0, None),
        seed=_optional_int(obj, "seed", 0, MAX_SEED),
        stop_token_ids=stop_ids,
    )
    n_choices = obj.get("n")
    if n_choices is not None and not (_is_int(n_choices) and n_choices == 1):
        raise RequestError("n", f"only n=1 is supported, got {n_choices!r}")
    _optional_str(obj, "user")  # accepted and ignored
    n = len(prompt_ids)
    if n >= max_context_tokens:
        raise RequestError(
            "prompt",
            f"prompt ({n} tokens) leaves no room for new tokens in the maximum context "
            f"of {max_context_tokens} tokens",
        )
    if n + max_tokens > max_context_tokens:
        raise RequestError(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the maximum context "
            f"of {max_context_tokens} tokens",
        )
    return CompletionRequest(
        prompt_ids=prompt_ids,
        params=params,
        stop_strings=stop_strings,
        stream=_bool(obj, "stream"),
        return_token_ids=_bool(obj, "return_token_ids"),
        model=_optional_str(obj, "model"),
        echo_prompt_text=prompt_text,
    )


def _parse_stop(stop: object, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise RequestError("stop", f"must be a string or a list, not {_json_type(stop)}")
    if len(items) > MAX_STOP:
        raise RequestError("stop", f"at most {MAX_STOP} entries, got {len(items)}")
    strings: list[str] = []
    ids: list[int] = []
    for i, item in enumerate(items):
        where = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if isinstance(item, str):
            if not item:
                raise RequestError(where, "must not be empty")
            strings.append(item)
        elif _is_int(item):
            ids.append(_token_id(where, item, vocab_size))
        else:
            raise RequestError(where, f"must be a string or a token id, not {_json_type(item)}")
    return tuple(strings), tuple(ids)


# ---- scalar helpers (JSON null = the default) ------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(where: str, value: object, vocab_size: int) -> int:
    if not _is_int(value):
        raise RequestError(where, f"must be a token id (an integer), not {_json_type(value)}")
    assert isinstance(value, int)
    if not 0 <= value < vocab_size:
        raise RequestError(where, f"token id {value} is outside the vocabulary [0, {vocab_size})")
    return value


def _optional_int(obj: Mapping[str, object], key: str, low: int, high: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(key, f"must be an integer, not {_json_type(value)}")
    assert isinstance(value, int)
    if not low <= value <= high:
        raise RequestError(key, f"must be in [{low}, {high}], got {value}")
    return value


def _int(obj: Mapping[str, object], key: str, default: int, low: int, high: int | None) -> int:
    value = obj.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(key, f"must be an integer, not {_json_type(value)}")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(key, f"must be {bound}, got {value}")
    return value


def _float(
    obj: Mapping[str, object],
    key: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool,
) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RequestError(key, f"must be a number, not {_json_type(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(key, f"must be a finite number, got {value}")
    if (value <= low if low_open else value < low) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(key, f"must be in {interval}, got {value}")
    return float(value)


def _bool(obj: Mapping[str, object], key: str) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(key, f"must be a boolean, not {_json_type(value)}")
    return value


def _optional_str(obj: Mapping[str, object], key: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise RequestError(key, f"must be a string, not {_json_type(value)}")


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
