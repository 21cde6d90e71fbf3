"""OpenAI-style error bodies the router answers with itself (the shape is the shared
`http_rules.error_document`), the SSE error event that ends a relayed stream, and reading an
error body from upstream."""

from __future__ import annotations

import json
from typing import Any, Final, Literal

from aiohttp import web

from dsv4_common.api.http_rules import error_document

ErrorType = Literal["invalid_request_error", "server_error"]
RETRY_AFTER_S: Final = 1
JSON_CONTENT_TYPE: Final = "application/json; charset=utf-8"
# How much of an upstream error body is kept for the router's own message.
MAX_UPSTREAM_MESSAGE_CHARS: Final = 500
# `error.code` of the event that ends a relayed stream: the decode's connection broke, or the
# decode went silent and missed its probes (`liveness.frozen_reason`).
BROKEN_CODE: Final = "upstream_broken"
STALLED_CODE: Final = "upstream_stalled"


def error_body(message: str, error_type: ErrorType, param: str | None = None) -> dict[str, Any]:
    return error_document(message, error_type, param)


def error_event(message: str, code: str, *, done: bool) -> bytes:
    """An SSE event with an OpenAI error (`server_error`), then `data: [DONE]` if `done`."""
    event = f"data: {json.dumps(error_document(message, 'server_error', None, code))}\n\n"
    return (event + "data: [DONE]\n\n" if done else event).encode()


def error_response(
    status: int,
    message: str,
    *,
    error_type: ErrorType = "server_error",
    param: str | None = None,
    retry: bool = False,
) -> web.Response:
    """`retry`: add `Retry-After` (the client may try again shortly)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return web.json_response(error_body(message, error_type, param), status=status, headers=headers)


def json_answer(
    status: int, document: dict[str, Any], *, retry_after_s: int | None = None
) -> tuple[int, list[tuple[str, str]], bytes]:
    """A JSON answer as (status, headers, body), as `web.json_response` would make it."""
    headers = [("Content-Type", JSON_CONTENT_TYPE)]
    if retry_after_s is not None:
        headers.append(("Retry-After", str(retry_after_s)))
    return status, headers, json.dumps(document).encode()


def upstream_message(payload: bytes) -> str:
    """`error.message` of an OpenAI-style error body, else the body's text (shortened)."""
    text = payload.decode("utf-8", errors="replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        message = doc["error"].get("message")
        if isinstance(message, str):
            text = message
    return text.strip()[:MAX_UPSTREAM_MESSAGE_CHARS] or "(empty body)"
