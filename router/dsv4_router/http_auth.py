"""aiohttp glue for API keys (`dsv4_common.api.api_key`), for the router's apps and the
worker's (light: aiohttp only, like `http_guard`, which the worker imports too).

`require_api_key(app, rule, status_port=...)` adds a middleware that answers 401 in OpenAI's
shape, with `WWW-Authenticate: Bearer`, before any handler runs (so before a body is read) for
a path the rule closes and a request without the key; the guard's middleware around it logs the
refusal as one line. `unauthorized_answer` is the same answer for the fast path (`fast_path`).
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

from dsv4_common.api.api_key import WWW_AUTHENTICATE, ApiKeyRule, unauthorized_document
from dsv4_router.errors import json_answer
from dsv4_router.http_guard import Handler
from dsv4_router.reply import Headers

RULE: Final = web.AppKey("dsv4_api_key_rule", ApiKeyRule)


def require_api_key(app: web.Application, rule: ApiKeyRule, *, status_port: bool) -> None:
    """Close `app`'s paths as `rule` says (nothing without a key). `status_port`: the app
    serves a status port (the rule's `open_status` applies there)."""
    app[RULE] = rule
    if not rule.enabled:
        return

    @web.middleware
    async def api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if rule.needs_key(request.path, status_port=status_port):
            authorization = request.headers.get("Authorization")
            if not rule.allows(authorization):
                return unauthorized_response(authorization)
        return await handler(request)

    app.middlewares.append(api_key)


def unauthorized_answer(authorization: bytes | str | None) -> tuple[int, Headers, bytes]:
    """(status, headers, body) of the 401."""
    status, headers, body = json_answer(401, unauthorized_document(authorization))
    return status, [*headers, WWW_AUTHENTICATE], body


def unauthorized_response(authorization: bytes | str | None) -> web.Response:
    status, headers, body = unauthorized_answer(authorization)
    return web.Response(status=status, headers=headers, body=body)
