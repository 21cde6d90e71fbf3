"""aiohttp glue for the HTTP rules of `dsv4_common.api.http_rules`, for the router's apps and
the worker's (this module and `http_listen` are all the worker imports of this package: they
are light, aiohttp only).

- `guarded_app(limits, ...)`: an Application whose middleware turns every error (aiohttp's
  own 404/405/413 too) into OpenAI's error body and logs one line per rejected, aborted or
  cancelled request, never a traceback for what a client did. Its `Guard` holds the limits
  and what the listener (`http_listen`) needs to know about the open connections.
- `read_json(request)`: the body with the limits (413 by Content-Length before reading, 408
  when it has not arrived within body_timeout_s) parsed by the shared rules (400s);
  `read_checked_body`: the same checks, the bytes as they came (what a proxy forwards).
- `make_runner(app)`: handlers are cancelled when their client disconnects (that is what
  aborts a request and frees its pages, streaming or not); idle_timeout_s is aiohttp's
  keep-alive timeout, which also closes a connection whose headers have not arrived by then.
- `new_protocol(server)`: the connection protocol the listener (`http_listen`) hands out; the
  answers aiohttp writes itself (400 for malformed HTTP, 500/504 past a handler) are
  OpenAI-shaped JSON too, and malformed HTTP logs one line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

from dsv4_common.api.http_rules import (
    BodyError,
    HttpLimits,
    body_timeout,
    body_too_large,
    check_content_length,
    connection_limit,
    error_document,
    error_type_for,
    one_line,
    parse_json_body,
)
from dsv4_router.errors import upstream_message

log = logging.getLogger(__name__)

# The listener accepts up to ACCEPT_BATCH connections per loop pass, before the bound can
# close any, and what it closes frees its descriptor one pass later: two batches and
# RESERVED_FDS (files, upstream sockets, pipes) stay outside the bound, so the process never
# runs out of descriptors (asyncio would log a traceback and stop accepting for a second).
ACCEPT_BATCH: Final = 32
RESERVED_FDS: Final = 32
PROBE_CONNECTIONS: Final = 32  # a probes-only port: kubelet, the operator, the router, scrapers
LINGER_S: Final = 2.0  # after answering a body it did not read, aiohttp drains it this long
REPORT_EVERY_S: Final = 5.0  # refusals and evictions are summed into one line this often

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Held(Protocol):
    """A connection the listener's bound counts that aiohttp does not hold (`fast_path`)."""

    opened_s: float

    @property
    def busy(self) -> bool: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Guard:
    """One app's limits and what it knows about its open connections."""

    limits: HttpLimits
    max_connections: int
    log: logging.Logger
    # Both pruned as connections go: opened_s at each new connection, handling per request.
    opened_s: dict[asyncio.BaseProtocol, float] = field(default_factory=dict)
    handling: dict[RequestHandler, web.Request] = field(default_factory=dict)
    evicted_handlers: set[RequestHandler] = field(default_factory=set)  # `note` logs them
    fresh: list[asyncio.BaseProtocol] = field(default_factory=list)  # handed out, not connected
    fast: set[Held] = field(default_factory=set)  # connected, not (yet) aiohttp's
    refused: int = 0
    evicted: int = 0
    reported_s: float = float("-inf")

    def busy(self, handler: RequestHandler) -> bool:
        """A whole request (headers and body) is in and being answered."""
        request = self.handling.get(handler)
        return request is not None and request.content.is_eof()

    def note(self, *, refused: int = 0, evicted: int = 0) -> None:
        self.refused += refused
        self.evicted += evicted
        now_s = time.monotonic()
        if now_s - self.reported_s < REPORT_EVERY_S:
            return
        self.log.warning(
            "at the connection limit (%d): closed %d incomplete connections, refused %d new "
            "ones (every open one busy)",
            self.max_connections,
            self.evicted,
            self.refused,
        )
        self.refused = self.evicted = 0
        self.reported_s = now_s


GUARD: Final = web.AppKey("dsv4_http_guard", Guard)


def guarded_app(
    limits: HttpLimits,
    *,
    fds_per_connection: int = 1,
    logger: logging.Logger = log,
    probes_only: bool = False,
) -> web.Application:
    """An Application that follows the rules (serve it with `make_runner` and `serve_on`).
    Its connection bound: `limits.max_connections`, else what the descriptors left free now
    allow (build it after the process's slow start-up)."""
    app = web.Application(client_max_size=limits.max_body_bytes)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = limits.max_connections or connection_limit(
        soft - _open_fds(),
        reserved_fds=RESERVED_FDS + 2 * ACCEPT_BATCH,
        fds_per_connection=fds_per_connection,
    )
    if probes_only:
        limit = min(limit, PROBE_CONNECTIONS)
    guard = Guard(limits, limit, logger)
    app[GUARD] = guard
    app.middlewares.append(_middleware(guard))
    return app


def _open_fds() -> int:
    try:
        return len(os.listdir("/dev/fd"))
    except OSError:
        return 0


def json_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after_s: int | None = None,
) -> web.Response:
    """An OpenAI-shaped error response."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    body = error_document(message, error_type_for(status), param, code)
    return web.json_response(body, status=status, headers=headers)


def body_error_response(exc: BodyError) -> web.Response:
    response = web.json_response(exc.document(), status=exc.status)
    if exc.status in (408, 413):  # the rest of the body is not read: end the connection
        response.force_close()
    return response


async def read_body(request: web.Request) -> bytes:
    """The whole body within the limits, or BodyError (413, 408, 400)."""
    limits = request.app[GUARD].limits
    check_content_length(request.content_length, limits.max_body_bytes)
    try:
        if request.content.is_eof():  # all here (the usual small body): no timer to arm
            return await request.read()
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except TimeoutError as exc:
        raise body_timeout(limits.body_timeout_s) from exc
    except web.HTTPRequestEntityTooLarge as exc:
        raise body_too_large(limits.max_body_bytes) from exc
    except (HttpProcessingError, RequestPayloadError) as exc:
        raise BodyError(400, f"the body is malformed: {one_line(str(exc))}") from exc
    except RuntimeError as exc:
        # aiohttp's "Connection closed." when the connection ends under the read (a client
        # that left, or one the connection bound evicted) before the handler is cancelled:
        # the middleware's one-line "aborted", not a traceback.
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the connection closed while its body was read") from exc
        raise


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, checked by the shared rules."""
    body = await read_body(request)
    return parse_json_body(body, max_depth=request.app[GUARD].limits.max_depth)


async def read_checked_body(request: web.Request) -> bytes:
    """The body as it came, once `read_json` would accept it (a proxy forwards the bytes)."""
    body = await read_body(request)
    parse_json_body(body, max_depth=request.app[GUARD].limits.max_depth)
    return body


def _middleware(guard: Guard) -> Any:
    @web.middleware
    async def guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Runs on every request: the log lines' "METHOD /path" is built only for a log line.
        protocol = request.protocol
        guard.handling[protocol] = request
        try:
            response = await handler(request)
        except BodyError as exc:
            response = body_error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _http_exception(request, exc)
        except asyncio.CancelledError:
            if protocol not in guard.evicted_handlers:
                guard.log.info("%s: cancelled (the client disconnected)", _where(request))
            raise
        except ConnectionResetError:
            transport = request.transport
            if transport is not None and not transport.is_closing():
                raise  # not this client's connection: a real failure
            guard.log.info("%s: aborted (the client went away)", _where(request))
            return web.Response(status=499)  # never sent: the connection is gone
        finally:
            guard.handling.pop(protocol, None)
            if guard.evicted_handlers:
                guard.evicted_handlers.discard(protocol)
        if response.status >= 400:
            where = _where(request)
            level = _log_level(response)
            guard.log.log(level, "%s -> %d: %s", where, response.status, _message(response))
        return response

    return guarded


def _log_level(response: web.StreamResponse) -> int:
    return log_level(response.status, "Retry-After" in response.headers)


def log_level(status: int, retry_after: bool) -> int:
    """A shed request (503 + Retry-After) is expected under load and counted by the shed
    metrics: a line for each would flood the log exactly when the process is busiest."""
    if status == 503 and retry_after:
        return logging.DEBUG
    return logging.WARNING if status >= 500 else logging.INFO


def _where(request: web.Request) -> str:
    return one_line(f"{request.method} {request.path}")


def _http_exception(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (no route, wrong method, body too large) in OpenAI's shape."""
    if exc.status == 404:
        message = f"Invalid URL ({request.method} {request.path})"
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"method {request.method} is not allowed on {request.path} (allowed: {allowed})"
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        message = body_too_large(request.app[GUARD].limits.max_body_bytes).message
    else:
        message = one_line(exc.text or exc.reason)
    response = json_error(exc.status, message)
    for name in ("Allow", "Retry-After"):
        if name in exc.headers:
            response.headers[name] = exc.headers[name]
    return response


def _message(response: web.StreamResponse) -> str:
    """error.message of an OpenAI-style body, for the log line."""
    body = getattr(response, "body", None)
    if not isinstance(body, bytes):
        return response.reason or ""
    return one_line(upstream_message(body))


class _ClientFaultLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp.server's logger: malformed HTTP from a client is one line, not a traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            text = str(msg) % args if args else str(msg)
            self.info("%s: %d %s", text, exc.code, one_line(exc.message))
            return
        super().exception(msg, *args, exc_info=exc_info, **kw)


class JsonErrorProtocol(RequestHandler):
    """aiohttp's connection protocol, whose own error answers are OpenAI-shaped JSON: what it
    writes without reaching the app (malformed HTTP: a bad request line, header or chunk
    size) and past a handler (an uncaught exception: 500, a timeout: 504). Same layout as
    its base (no new slots)."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) and status < 500:  # the client's fault
            reason = one_line(exc.message or message or "")
            text = f"malformed HTTP request: {reason}"
            self.logger.info("malformed HTTP from %s: %d %s", request.remote, status, reason)
        else:  # a real failure on our side: its traceback belongs in the log
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text = HTTPStatus(status).description
        if request.writer.output_size > 0:  # as aiohttp: nothing more can be said
            raise ConnectionError("the response was sent already; cannot send an error")
        response = json_error(status, text)
        response.force_close()
        return response


def new_protocol(server: web.Server) -> RequestHandler:
    """A protocol for one new connection to `server` (what `server()` builds, answering its
    own errors in JSON)."""
    return JsonErrorProtocol(server, loop=asyncio.get_running_loop(), **server._kwargs)


def make_runner(app: web.Application, *, shutdown_timeout_s: float = 20.0) -> web.AppRunner:
    limits = app[GUARD].limits
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=limits.idle_timeout_s,
        lingering_time=LINGER_S,
        logger=_ClientFaultLog(logging.getLogger("aiohttp.server"), {}),
        shutdown_timeout=shutdown_timeout_s,
    )
