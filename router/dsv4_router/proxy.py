"""Forwards one client request to a (prefill, decode) pair and relays the answer, retrying on
another pair while the client has not received a byte. The rules are in `app`'s docstring.

I/O (upstream HTTP). Which pair is `select.choose_pair`; what a failure excludes and what the
client gets when every attempt failed are the pure `failure_exclusions` and `give_up_status`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from dsv4_common.api.rank_config import Instance
from dsv4_router.choice import (
    InstanceTable,
    Pair,
    choose,
    choose_pair,
    host_port,
    unavailable_reason,
)
from dsv4_router.config import RouterSettings
from dsv4_router.errors import error_body, error_response, upstream_message
from dsv4_router.metrics import Outcome, RouterMetrics

log = logging.getLogger(__name__)

PREFILL_HEADER: Final = "X-DSV4-Prefill"
EVENT_STREAM: Final = "text/event-stream"
# Hop-by-hop headers and those aiohttp sets itself are never copied across.
_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
_NOT_FORWARDED: Final = _HOP_HEADERS | {"host", "accept-encoding", PREFILL_HEADER.lower()}
# The upstream body arrives decompressed; the date and server are the router's own.
_NOT_RETURNED: Final = _HOP_HEADERS | {"content-encoding", "date", "server"}


@dataclass(frozen=True, slots=True)
class Failure:
    """An attempt that failed before the client got a byte."""

    status: int | None  # decode's 5xx; None: no answer (connection failed, timed out)
    message: str
    excluded: tuple[Instance, ...]  # not to be tried again for this request


def failure_exclusions(pair: Pair, status: int | None) -> tuple[Instance, ...]:
    """502: decode could not use the prefill, so the prefill goes; 503 or no answer: decode
    itself could not serve; any other 5xx: both."""
    if status == 502:
        return (pair.prefill.instance,)
    if status is None or status == 503:
        return (pair.decode.instance,)
    return (pair.prefill.instance, pair.decode.instance)


def give_up_status(failures: list[Failure]) -> int:
    """502 when the last attempt got an upstream error other than 503 (its message is passed
    on); otherwise 503 with Retry-After: nothing was free, or the decode was busy or gone."""
    last = failures[-1] if failures else None
    if last is not None and last.status is not None and last.status != 503:
        return 502
    return 503


def forward_headers(headers: CIMultiDictProxy[str], prefill: Instance) -> CIMultiDict[str]:
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_FORWARDED)
    out[PREFILL_HEADER] = host_port(prefill.host, prefill.kv_port)
    return out


def returned_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_RETURNED)


class Proxy:
    def __init__(
        self,
        table: InstanceTable,
        settings: RouterSettings,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        clock: Callable[[], float],
    ) -> None:
        self._table = table
        self._settings = settings
        self._metrics = metrics
        self._session = session
        self._clock = clock

    async def completion(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Route one completion; counts its outcome once (`aborted` if cancelled, which is what
        a client disconnect does to the handler)."""
        outcome: Outcome = "aborted"
        try:
            response, outcome = await self._route(request, body)
            return response
        finally:
            self._metrics.count(outcome)

    async def _route(self, request: web.Request, body: bytes) -> tuple[web.StreamResponse, Outcome]:
        settings = self._settings
        excluded: set[Instance] = set()
        failures: list[Failure] = []
        for attempt in range(settings.max_attempts):
            records, now_s = self._table.records(), self._clock()
            pair = choose_pair(records, now_s, settings.stale_after_s, frozenset(excluded))
            if pair is None:
                reason = unavailable_reason(
                    records, now_s, settings.stale_after_s, frozenset(excluded)
                )
                break
            if attempt > 0:
                self._metrics.retries.inc()
            result = await self._attempt(request, body, pair)
            if not isinstance(result, Failure):
                return result
            log.warning("attempt %d of %s failed: %s", attempt + 1, request.path, result.message)
            failures.append(result)
            excluded.update(result.excluded)
        else:
            reason = f"{settings.max_attempts} attempts failed"
        return _give_up(failures, reason)

    async def _attempt(
        self, request: web.Request, body: bytes, pair: Pair
    ) -> tuple[web.StreamResponse, Outcome] | Failure:
        decode = pair.decode.instance
        where = f"decode {host_port(decode.host, decode.http_port)}"
        url = f"http://{host_port(decode.host, decode.http_port)}{request.path_qs}"
        headers = forward_headers(request.headers, pair.prefill.instance)
        timeout_s = self._settings.first_byte_timeout_s
        pair.prefill.sent()
        pair.decode.sent()
        started_s = self._clock()
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    upstream = await self._session.post(url, data=body, headers=headers)
            except TimeoutError:
                return Failure(None, f"{where}: no response within {timeout_s:g} s", (decode,))
            except (aiohttp.ClientError, OSError) as exc:
                return Failure(None, f"{where}: {exc or type(exc).__name__}", (decode,))
            self._metrics.first_byte_s.observe(self._clock() - started_s)
            try:
                return await self._relay(request, upstream, pair, where)
            finally:
                # Reuse the connection only if its body was read to the end; otherwise close it
                # at once, which the decode worker takes as an abort (it frees the pages).
                if upstream.content.at_eof():
                    upstream.release()
                else:
                    upstream.close()
        finally:
            pair.prefill.done()
            pair.decode.done()

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, pair: Pair, where: str
    ) -> tuple[web.StreamResponse, Outcome] | Failure:
        try:
            if upstream.status >= 500:
                message = f"{where}: {upstream.status}: {upstream_message(await upstream.read())}"
                return Failure(upstream.status, message, failure_exclusions(pair, upstream.status))
            if upstream.content_type == EVENT_STREAM:
                return await self._stream(request, upstream, where)
            payload = await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return Failure(None, f"{where}: {exc or type(exc).__name__}", (pair.decode.instance,))
        response = web.Response(
            status=upstream.status, body=payload, headers=returned_headers(upstream.headers)
        )
        return response, "ok" if upstream.status < 400 else "client_error"

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, where: str
    ) -> tuple[web.StreamResponse, Outcome]:
        """Relay each chunk as it arrives. Past this point the client has bytes: a broken
        upstream ends the stream with an error event, never a retry."""
        response = web.StreamResponse(
            status=upstream.status, headers=returned_headers(upstream.headers)
        )
        await response.prepare(request)
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                log.warning("%s: stream broke: %s", where, exc or type(exc).__name__)
                message = f"{where}: the stream broke: {exc or type(exc).__name__}"
                event = json.dumps(error_body(message, "server_error"))
                await _write_quietly(response, f"data: {event}\n\n".encode())
                return response, "upstream_error"
            if not chunk:
                break
            if not await _write_quietly(response, chunk):
                return response, "aborted"
        await response.write_eof()
        return response, "ok" if upstream.status < 400 else "client_error"

    async def models(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models from the best eligible decode (another one if it does not answer)."""
        excluded: set[Instance] = set()
        timeout = aiohttp.ClientTimeout(total=self._settings.connect_timeout_s * 2)
        for _ in range(self._settings.max_attempts):
            record = choose(
                self._table.records(),
                "decode",
                self._clock(),
                self._settings.stale_after_s,
                frozenset(excluded),
            )
            if record is None:
                break
            where = host_port(record.instance.host, record.instance.http_port)
            try:
                async with self._session.get(f"http://{where}/v1/models", timeout=timeout) as up:
                    payload = await up.read()
                    if up.status < 500:
                        headers = returned_headers(up.headers)
                        return web.Response(status=up.status, body=payload, headers=headers)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("decode %s: /v1/models failed: %s", where, exc or type(exc).__name__)
            excluded.add(record.instance)
        return error_response(503, "no ready decode instance answered /v1/models", retry=True)


def _give_up(failures: list[Failure], reason: str) -> tuple[web.Response, Outcome]:
    if give_up_status(failures) == 502:
        return error_response(502, failures[-1].message), "upstream_error"
    last = f"; last failure: {failures[-1].message}" if failures else ""
    message = f"no instance pair can take the request: {reason}{last}"
    return error_response(503, message, retry=True), "unavailable"


async def _write_quietly(response: web.StreamResponse, data: bytes) -> bool:
    """Write to the client; False if it has gone away."""
    try:
        await response.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        return False
    return True
