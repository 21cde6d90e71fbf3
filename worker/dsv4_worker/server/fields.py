"""JSON field readers for request bodies: each returns the field's value or its default (JSON
null means the default) and raises `RequestError` naming the field otherwise. Pure.

`refuse_unless` is the rule for an OpenAI field this server cannot honor: its null and
default values are accepted (clients send them), anything that asks for the behaviour is a
400 saying why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A client error; `field` names the JSON field ("" for the whole body). HTTP 400 unless
    `status` says otherwise (404 for an unknown model), with an OpenAI error `code`."""

    def __init__(self, field: str, message: str, *, status: int = 400, code: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message
        self.status = status
        self.code = code


def json_type(value: object) -> str:
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


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text(where: str, value: str) -> str:
    """A string that can become UTF-8 (JSON can carry a lone surrogate, "\\ud800", which
    cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end].encode("unicode_escape").decode()
        raise RequestError(where, f"is not valid Unicode: lone surrogate {bad}") from exc
    return value


def token_id(where: str, value: object, vocab_size: int) -> int:
    if not is_int(value):
        raise RequestError(where, f"must be a token id (an integer), not {json_type(value)}")
    assert isinstance(value, int)
    if not 0 <= value < vocab_size:
        raise RequestError(where, f"token id {value} is outside the vocabulary [0, {vocab_size})")
    return value


def optional_int(obj: Mapping[str, object], key: str, low: int, high: int) -> int | None:
    if obj.get(key) is None:
        return None
    return integer(obj, key, low, low, high)


def integer(obj: Mapping[str, object], key: str, default: int, low: int, high: int | None) -> int:
    value = obj.get(key)
    if value is None:
        return default
    if not is_int(value):
        raise RequestError(key, f"must be an integer, not {json_type(value)}")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(key, f"must be {bound}, got {value}")
    return value


def number(
    obj: Mapping[str, object],
    key: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
) -> float:
    value = obj.get(key)
    if value is None:
        return default
    return bounded_number(key, value, low, high, low_open=low_open)


def bounded_number(
    where: str, value: object, low: float, high: float, *, low_open: bool = False
) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RequestError(where, f"must be a number, not {json_type(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(where, f"must be a finite number, got {value}")
    if (value <= low if low_open else value < low) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(where, f"must be in {interval}, got {value}")
    return float(value)


def boolean(obj: Mapping[str, object], key: str, default: bool = False) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(key, f"must be a boolean, not {json_type(value)}")
    return value


def optional_str(obj: Mapping[str, object], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return text(key, value)
    raise RequestError(key, f"must be a string, not {json_type(value)}")


def optional_object(obj: Mapping[str, object], key: str) -> Mapping[str, object] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(key, f"must be an object, not {json_type(value)}")
    return value


def one_of(obj: Mapping[str, object], key: str, allowed: tuple[str, ...]) -> str | None:
    value = optional_str(obj, key)
    if value is not None and value not in allowed:
        raise RequestError(key, f"must be one of {', '.join(allowed)}, got {value!r}")
    return value


def refuse_unless(
    obj: Mapping[str, object],
    key: str,
    harmless: Callable[[object], bool],
    why: str,
    where: str = "",
) -> None:
    """A field this server cannot honor: null and `harmless` values pass, others are a 400
    saying `why` (the field named under `where`, an enclosing object's path)."""
    value = obj.get(key)
    if value is not None and not harmless(value):
        raise RequestError(f"{where}.{key}" if where else key, why)


def unknown_fields(obj: Mapping[str, object], allowed: frozenset[str], where: str = "") -> None:
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        at = f"{where}.{unknown[0]}" if where else unknown[0]
        raise RequestError(at, f"unknown field; allowed fields are {', '.join(sorted(allowed))}")


def extra_fields(obj: Mapping[str, object], allowed: frozenset[str]) -> tuple[str, ...]:
    """The keys of `obj` that are not `allowed`, sorted."""
    return tuple(sorted(str(k) for k in obj if k not in allowed))
