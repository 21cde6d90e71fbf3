"""A request's one id, end to end (pure).

The entry point names each request: the client's `X-Request-Id` when it sends a valid one,
else a new random 32-hex-digit id. The router sends each attempt to a decode under
`attempt_id` (the first under the id itself, a retry under `<id>.<attempt>`: a retry is a new
request for the workers, and its namesake may still hold pages on one of them). The worker
answers under the id it got (the `id` of the completion, `cmpl-<id>`, and the `X-Request-Id`
response header), gives each choice `choice_id` as its engine request id, and a PD decode uses
that id as the transfer's room: the prefill's engine request and every transfer tag carry it
too.

An id is 1 to MAX_REQUEST_ID_CHARS characters of [A-Za-z0-9._:-] (safe in logs; '/' stays free
for `choice_id`); a worker takes MAX_FORWARDED_ID_CHARS, room for the router's attempt suffix.
"""

from __future__ import annotations

import random
import re
from typing import Final

REQUEST_ID_HEADER: Final = "X-Request-Id"
MAX_REQUEST_ID_CHARS: Final = 128
MAX_FORWARDED_ID_CHARS: Final = MAX_REQUEST_ID_CHARS + 8  # + ".<attempt>"
_VALID: Final = re.compile(r"[A-Za-z0-9._:-]+")


class InvalidRequestId(ValueError):
    """The client's X-Request-Id breaks the rules above (the message names the header)."""


def new_request_id() -> str:
    """32 hex digits of 128 random bits. Not a secret, so `random` (seeded from the OS, and
    reseeded in a forked child) rather than uuid4's urandom call: ~5 us less per request on
    the router's hot path."""
    return f"{random.getrandbits(128):032x}"


def request_id_of(header: str | None, max_chars: int = MAX_REQUEST_ID_CHARS) -> str:
    """The request's id: the client's header value, checked, or a new one when it sent none."""
    if header is None:
        return new_request_id()
    if not 0 < len(header) <= max_chars or not _VALID.fullmatch(header):
        shown = header if len(header) <= 40 else header[:40] + "..."
        raise InvalidRequestId(
            f"{REQUEST_ID_HEADER} must be 1 to {max_chars} characters of "
            f"A-Z a-z 0-9 . _ : -, got {shown!r}"
        )
    return header


def attempt_id(request_id: str, attempt: int) -> str:
    """The id of the router's attempt number `attempt` (0: the first) at a request."""
    return request_id if attempt == 0 else f"{request_id}.{attempt}"


def choice_id(request_id: str, index: int, choices: int) -> str:
    """The engine request id of choice `index` of `choices` (one choice: the request's id)."""
    return request_id if choices == 1 else f"{request_id}/{index}"
