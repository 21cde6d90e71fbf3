"""The HTTP rules the worker's API and the router both follow, as data and pure functions.

| what the client did                                    | answer                          |
| ------------------------------------------------------ | ------------------------------- |
| body not UTF-8, not JSON or not an object; a number    | 400, `param` null               |
| of more than 4300 digits, NaN or Infinity              |                                 |
| a string or key holding a lone surrogate "\\ud800", a  | 400, `param` = its path         |
| number that overflows (1e999), nesting past max_depth  |                                 |
| Content-Length (or the body read) over the limit       | 413                             |
| a body that has not fully arrived within body_timeout  | 408, connection closed          |
| no whole request within idle_timeout_s of the last one | connection closed (keep-alive   |
| (or of connecting): idle, or headers still arriving    | and header timeout in one)      |
| max_connections open and one more arrives              | the oldest connection without a |
|                                                        | whole request is closed; when   |
|                                                        | every one is busy, a fast 503   |

Every error body is OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`. Pure:
no I/O (the servers' aiohttp glue is `dsv4_router.http_guard`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

ErrorType = Literal["invalid_request_error", "not_found_error", "server_error"]

# Token-id prompts of a long context run to megabytes; the router forwards bodies verbatim.
DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Deep enough for any OpenAI request (a json_schema response_format included); the JSON
# parser itself stops near the interpreter's recursion limit (~1000).
DEFAULT_MAX_DEPTH: Final = 64
MAX_CONNECTIONS_CAP: Final = 4096
MIN_CONNECTIONS: Final = 16
LOG_LINE_CHARS: Final = 300


def error_document(
    message: str, error_type: ErrorType, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_type_for(status: int) -> ErrorType:
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """One server's limits on its clients (`None` connections: from the fd limit)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    body_timeout_s: float = 60.0  # headers in -> whole body in
    # connected or answered -> next request's headers in. Longer than the 60 s idle timeout
    # of common load balancers in front, so they never reuse a connection being closed.
    idle_timeout_s: float = 75.0
    max_connections: int | None = None


def http_limits(
    *,
    body_timeout_s: float | None = None,
    idle_timeout_s: float | None = None,
    max_connections: int | None = None,
) -> HttpLimits:
    """The limits from the `dsv4 serve` flags (None: the default)."""
    base = HttpLimits()
    return HttpLimits(
        body_timeout_s=body_timeout_s or base.body_timeout_s,
        idle_timeout_s=idle_timeout_s or base.idle_timeout_s,
        max_connections=max_connections,
    )


class BodyError(ValueError):
    """A request body refused before any handler sees it; `param` names the field."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def document(self) -> dict[str, Any]:
        return error_document(self.message, error_type_for(self.status), self.param, self.code)


def check_content_length(length: int | None, max_body_bytes: int) -> None:
    """413 before reading a body announced larger than the limit."""
    if length is not None and length > max_body_bytes:
        raise body_too_large(max_body_bytes, length)


def body_too_large(max_body_bytes: int, length: int | None = None) -> BodyError:
    size = f"{length} bytes" if length is not None else "the body"
    return BodyError(
        413, f"{size} exceeds the limit of {max_body_bytes} bytes", code="request_too_large"
    )


def body_timeout(timeout_s: float) -> BodyError:
    return BodyError(408, f"the body did not arrive within {timeout_s:g} s", code="request_timeout")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# Built once: json.loads(text, parse_constant=...) builds a decoder and its scanner per call.
_DECODER: Final = json.JSONDecoder(parse_constant=_no_constant)


def parse_json_body(raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """A request body -> its JSON object, or BodyError (400) saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the body is not UTF-8 (byte {exc.start})") from exc
    try:
        if text.startswith("\ufeff"):  # as json.loads says it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        doc = _DECODER.decode(text)
    except RecursionError as exc:
        raise BodyError(400, f"the body is nested deeper than {max_depth} levels") from exc
    except ValueError as exc:  # JSONDecodeError, NaN, and ints over 4300 digits
        why = one_line(str(exc))
        if "integer string conversion" in why:
            why = f"a number has more than {sys.get_int_max_str_digits()} digits"
        raise BodyError(400, f"the body is not valid JSON ({why})") from exc
    if not isinstance(doc, dict):
        raise BodyError(400, f"the body must be a JSON object, not {json_type(doc)}")
    check_values(doc, max_depth)
    return doc


def check_values(doc: object, max_depth: int) -> None:
    """Every string encodes to UTF-8 (no lone surrogates), every number is finite, nothing
    nests deeper than `max_depth`; BodyError names the first offender's path. Iterative: a
    deep document cannot exhaust the stack here. A document that passes (nearly all) is
    checked without building any path; only one that may not is walked again, naming."""
    if not _passes(doc, max_depth):
        _check_naming(doc, max_depth)


def _passes(doc: object, max_depth: int) -> bool:
    """True only if `check_values` passes `doc` (False: walk it again to name the fault; any
    type other than JSON's is left to that walk)."""
    stack: list[tuple[object, int]] = [(doc, 0)]
    while stack:
        container, depth = stack.pop()
        if depth >= max_depth:
            return False
        if type(container) is dict:
            for key in container:
                if not key.isascii() and not _encodes(key):
                    return False
            items: Iterable[object] = container.values()
        elif type(container) is list:
            items = container
        else:
            return False
        for item in items:
            if isinstance(item, str):
                if not item.isascii() and not _encodes(item):
                    return False
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1))
            elif isinstance(item, float):
                if not math.isfinite(item):
                    return False
            elif item is not None and not isinstance(item, int):  # bool is an int
                return False
    return True


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_naming(doc: object, max_depth: int) -> None:
    stack: list[tuple[object, str, int]] = [(doc, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path or None)
        elif isinstance(value, float) and not math.isfinite(value):
            raise BodyError(400, "must be a finite number", path or None)
        elif isinstance(value, dict | list):
            if depth >= max_depth:
                raise BodyError(400, f"nests deeper than {max_depth} levels", path or None)
            if isinstance(value, dict):
                for key, item in value.items():
                    child = f"{path}.{printable(key)}" if path else printable(key)
                    _check_text(key, child)
                    stack.append((item, child, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"character {exc.start}"
        raise BodyError(
            400, f"holds a lone surrogate at {where} (not valid Unicode)", path
        ) from exc


def json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def connection_limit(
    soft_nofile: int, *, reserved_fds: int, fds_per_connection: int, cap: int = MAX_CONNECTIONS_CAP
) -> int:
    """Client connections a process can hold without running out of file descriptors
    (`reserved_fds` for everything else it opens), within [MIN_CONNECTIONS, cap]."""
    fit = (soft_nofile - reserved_fds) // max(1, fds_per_connection)
    return max(MIN_CONNECTIONS, min(cap, fit))


@dataclass(frozen=True, slots=True)
class OpenConnection:
    opened_s: float
    busy: bool  # a whole request is in and being answered


@dataclass(frozen=True, slots=True)
class Admission:
    accept: bool
    evict: tuple[int, ...] = ()  # indices of the open connections to close first


def admit(open_connections: Sequence[OpenConnection], limit: int) -> Admission:
    """Whether one more connection may open while `open_connections` are open. At the limit
    the oldest connections without a whole request (idle, or headers or body still arriving)
    are closed to make room; when every one is busy the new one is refused."""
    excess = len(open_connections) + 1 - limit
    if excess <= 0:
        return Admission(True)
    idle = sorted((c.opened_s, i) for i, c in enumerate(open_connections) if not c.busy)
    if len(idle) < excess:
        return Admission(False)
    return Admission(True, tuple(i for _, i in idle[:excess]))


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates) as a backslash escape."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: str, max_chars: int = LOG_LINE_CHARS) -> str:
    """`text` printable on one line (whitespace runs collapsed), shortened to `max_chars`."""
    flat = " ".join(printable(text).split())
    return flat if len(flat) <= max_chars else flat[: max_chars - 3] + "..."
