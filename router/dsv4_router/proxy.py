"""Forwards one client request to a (prefill, decode) pair and relays the answer, retrying on
another pair while the client has not received a byte. The rules are in `app`'s docstring.

The client's side is a `reply.Incoming` and its `reply.Reply` (aiohttp's or `fast_path`'s).
I/O (upstream HTTP): completions go over `upstream`'s pooled keep-alive connections, the
client's body and end-to-end headers as they came (`request_head`), the answer's body relayed
as it came; /v1/models goes through aiohttp's client. Which pair is `choice.choose_pair`; what
a failure excludes and what the client gets when every attempt failed are the pure
`failure_exclusions` and `give_up_status`. A decode that goes silent is watched
(`upstream.Watch`); whether to give up on it is `liveness.frozen_reason` and
`liveness.give_up_frozen`, asked by `_StallCheck`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from dsv4_common.api.lifecycle import DRAIN_CODE
from dsv4_common.api.pd_secret import PREFILL_AUTH_HEADER, PREFILL_HEADER, sign_route
from dsv4_common.api.rank_config import Instance
from dsv4_common.api.request_id import (
    REQUEST_ID_HEADER,
    InvalidRequestId,
    attempt_id,
    request_id_of,
)
from dsv4_router.choice import (
    InstanceRecord,
    InstanceTable,
    Pair,
    ShedReason,
    choose,
    choose_pair,
    host_port,
    unavailable,
)
from dsv4_router.config import RouterSettings
from dsv4_router.drain import CUT
from dsv4_router.errors import (
    BROKEN_CODE,
    RETRY_AFTER_S,
    STALLED_CODE,
    error_body,
    error_event,
    error_response,
    json_answer,
    upstream_message,
)
from dsv4_router.liveness import (
    LivenessRule,
    StallRule,
    frozen_reason,
    give_up_frozen,
    stale_reason,
)
from dsv4_router.metrics import Outcome, RouterMetrics
from dsv4_router.reply import Incoming, Reply, end_quietly
from dsv4_router.upstream import Answer, Upstream, UpstreamStalled

log = logging.getLogger(__name__)

REQUEST_ID_RAW: Final = REQUEST_ID_HEADER.lower().encode()
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
# `expect`: the body is always sent at once (an interim 100 from the worker is skipped).
# `authorization`: the client's credential is the router's to check; the router sends its own.
_NOT_FORWARDED: Final = _HOP_HEADERS | {
    "authorization",
    "host",
    "accept-encoding",
    "expect",
    PREFILL_HEADER.lower(),
    PREFILL_AUTH_HEADER.lower(),  # the router's own signature of its choice
    REQUEST_ID_HEADER.lower(),  # each attempt's own (`attempt_id`)
}
_NOT_FORWARDED_RAW: Final = frozenset(name.encode() for name in _NOT_FORWARDED)
# The date and server are the router's own. Through aiohttp (/v1/models) the body arrives
# decompressed, so its content-encoding goes too; a completion's body is relayed as it came.
_NOT_RELAYED: Final = _HOP_HEADERS | {"date", "server"}
_NOT_RETURNED: Final = _NOT_RELAYED | {"content-encoding"}


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
    on); otherwise 503: nothing was free, or the decode was busy or gone. Both carry
    Retry-After (the next attempt may find a healed or another pair)."""
    last = failures[-1] if failures else None
    if last is not None and last.status is not None and last.status != 503:
        return 502
    return 503


def shed_reason(failures: list[Failure], found: ShedReason) -> ShedReason:
    """The label of a 503 the router gives: `upstream_shed` when the last decode tried shed
    the request itself (503), else why no pair was left."""
    if failures and failures[-1].status == 503:
        return "upstream_shed"
    return found


def returned_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_RETURNED)


def request_head(
    method: str,
    target: str,
    host: str,
    headers: Iterable[tuple[bytes, bytes]],
    prefill: Instance,
    body_bytes: int,
    request_id: str,
    credential: bytes = b"",
    route_key: bytes | None = None,
) -> bytes:
    """The HTTP/1.1 request line and headers for the decode: the client's end-to-end headers
    as they came (`headers`: raw pairs; never its Authorization), its Host, the router's own
    `credential` (an Authorization line, or nothing), the attempt's request id, the prefill's
    KV address and this router's signature of it (`route_key`: the deployment's PD secret),
    the body length. The connection stays open (HTTP/1.1's default)."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1"), credential]
    lines += [
        name + b": " + value + b"\r\n"
        for name, value in headers
        if name.lower() not in _NOT_FORWARDED_RAW
    ]
    prefill_at = host_port(prefill.host, prefill.kv_port)
    signed = ""
    if route_key is not None:
        signature = sign_route(route_key, request_id, prefill_at, time.time())
        signed = f"{PREFILL_AUTH_HEADER}: {signature}\r\n"
    lines.append(
        f"{REQUEST_ID_HEADER}: {request_id}\r\n{PREFILL_HEADER}: {prefill_at}\r\n{signed}"
        f"Content-Length: {body_bytes}\r\n\r\n".encode("latin-1")
    )
    return b"".join(lines)


def relayed_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _NOT_RELAYED]


@dataclass(slots=True, eq=False)
class _StallCheck:
    """One attempt's `Watch` verdict: why to give up on its decode (`liveness`: silent and
    its latest probe missed, and the client has bytes, another pair is free, or the decode
    is stale), or None to wait on."""

    table: InstanceTable
    liveness: LivenessRule
    stall: StallRule
    clock: Callable[[], float]
    decode: InstanceRecord
    excluded: frozenset[Instance]
    answered: bool = False  # the client has bytes (a stream's head went out)

    def __call__(self, silent_s: float) -> str | None:
        why = frozen_reason(silent_s, self.decode.liveness, self.stall)
        if why is None or self.answered:  # answered: `give_up_frozen` holds whatever the rest
            return why
        now_s, rule = self.clock(), self.liveness
        stale = stale_reason(self.decode.liveness, now_s, rule) is not None
        others = self.excluded | {self.decode.instance}
        other_pair = choose_pair(self.table.records(), now_s, rule, others) is not None
        return why if give_up_frozen(answered=False, other_pair=other_pair, stale=stale) else None


class Proxy:
    def __init__(
        self,
        table: InstanceTable,
        settings: RouterSettings,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        upstream: Upstream,
        clock: Callable[[], float],
    ) -> None:
        """`upstream` carries completions; `session`, the rest (/v1/models)."""
        self._table = table
        self._settings = settings
        self._metrics = metrics
        self._session = session
        self._upstream = upstream
        self._clock = clock
        self._rules = (settings.liveness, settings.stall)  # the settings are frozen
        credential = settings.auth.credential()
        self._credential = (
            b"" if credential is None else f"Authorization: {credential}\r\n".encode()
        )

    async def completion(self, incoming: Incoming, reply: Reply) -> None:
        """Route one completion, answering through `reply`; counts its outcome once
        (`aborted` if cancelled, which is what a client disconnect does to the handler)."""
        settings = self._settings
        outcome: Outcome = "aborted"
        excluded: set[Instance] = set()
        failures: list[Failure] = []
        try:
            try:
                rid = request_id_of(incoming.header(REQUEST_ID_RAW))
            except InvalidRequestId as exc:
                outcome = "client_error"
                document = error_body(str(exc), "invalid_request_error", REQUEST_ID_HEADER)
                reply.answer(*json_answer(400, document))
                return
            for attempt in range(settings.max_attempts):
                records, now_s = self._table.records(), self._clock()
                pair = choose_pair(records, now_s, self._rules[0], frozenset(excluded))
                if pair is None:
                    shed, reason = unavailable(records, now_s, self._rules[0], frozenset(excluded))
                    break
                if attempt > 0:
                    self._metrics.retries.inc()
                result = await self._attempt(
                    incoming, reply, pair, frozenset(excluded), attempt_id(rid, attempt)
                )
                if not isinstance(result, Failure):
                    outcome = result
                    return
                log.warning(
                    "attempt %d of %s failed: %s", attempt + 1, incoming.path, result.message
                )
                failures.append(result)
                excluded.update(result.excluded)
            else:
                shed, reason = "failed", f"{settings.max_attempts} attempts failed"
            outcome = _give_up(failures, reason, reply, rid)
            if outcome == "unavailable":
                self._metrics.shed(shed_reason(failures, shed))
        finally:
            self._metrics.count(outcome)

    async def _attempt(
        self,
        incoming: Incoming,
        reply: Reply,
        pair: Pair,
        excluded: frozenset[Instance],
        request_id: str,
    ) -> Outcome | Failure:
        decode = pair.decode.instance
        address = host_port(decode.host, decode.http_port)
        body = incoming.body
        head = request_head(
            incoming.method,
            incoming.target,
            address,
            incoming.headers,
            pair.prefill.instance,
            len(body),
            request_id,
            self._credential,
            self._settings.route_key,
        )
        timeout_s = self._settings.first_byte_timeout_s
        liveness, stall = self._rules
        check = _StallCheck(self._table, liveness, stall, self._clock, pair.decode, excluded)
        pair.prefill.sent()
        pair.decode.sent()
        started_s = self._clock()
        try:
            try:
                upstream = await self._upstream.send(
                    decode.host, decode.http_port, head, body, timeout_s=timeout_s, watch=check
                )
            except TimeoutError:
                message = f"decode {address}: no response within {timeout_s:g} s"
                return Failure(None, message, (decode,))
            except OSError as exc:
                return Failure(None, f"decode {address}: {exc or type(exc).__name__}", (decode,))
            self._metrics.first_byte_s.observe(self._clock() - started_s)
            try:
                status = upstream.status
                if status < 500 and upstream.content_type != EVENT_STREAM:
                    payload = upstream.take_body()  # the usual small answer: already whole
                    if payload is None:
                        payload = await upstream.read()
                    reply.answer(status, relayed_headers(upstream.headers), payload)
                    return "ok" if status < 400 else "client_error"
                where = f"decode {address}"
                return await self._relay(incoming, reply, upstream, pair, check, where)
            except OSError as exc:
                return Failure(None, f"decode {address}: {exc or type(exc).__name__}", (decode,))
            finally:
                # Reuse the connection only if its body was read to the end; otherwise close it
                # at once, which the decode worker takes as an abort (it frees the pages).
                if upstream.complete:
                    upstream.release()
                else:
                    upstream.close()
        finally:
            pair.prefill.done()
            pair.decode.done()

    async def _relay(
        self,
        incoming: Incoming,
        reply: Reply,
        upstream: Answer,
        pair: Pair,
        check: _StallCheck,
        where: str,
    ) -> Outcome | Failure:
        """A 5xx (a failed attempt) or an event stream; OSError if the upstream breaks."""
        if upstream.status >= 500:
            message = f"{where}: {upstream.status}: {upstream_message(await upstream.read())}"
            return Failure(upstream.status, message, failure_exclusions(pair, upstream.status))
        return await self._stream(incoming, reply, upstream, check, where)

    async def _stream(
        self, incoming: Incoming, reply: Reply, upstream: Answer, check: _StallCheck, where: str
    ) -> Outcome:
        """Relay each chunk as it arrives. Past this point the client has bytes: a broken
        upstream ends the stream with an error event, a stalled one with an error event and
        `[DONE]`, never a retry."""
        await reply.start(upstream.status, relayed_headers(upstream.headers))
        check.answered = True
        while True:
            try:
                chunk = await upstream.read_chunk()
            except asyncio.CancelledError:  # the drain cut it (or the client left: no one reads)
                if await reply.write(error_event(CUT, DRAIN_CODE, done=True)):
                    await end_quietly(reply)
                raise
            except UpstreamStalled as exc:
                log.warning("%s: stream stalled: %s", where, exc)
                message = f"{where} stalled: {exc}"
                if await reply.write(error_event(message, STALLED_CODE, done=True)):
                    await end_quietly(reply)
                return "upstream_error"
            except OSError as exc:
                log.warning("%s: stream broke: %s", where, exc or type(exc).__name__)
                message = f"{where}: the stream broke: {exc or type(exc).__name__}"
                await reply.write(error_event(message, BROKEN_CODE, done=False))
                return "upstream_error"
            if not chunk:
                break
            if not await reply.write(chunk):
                log.info("%s %s: aborted (the client went away)", incoming.method, incoming.path)
                return "aborted"
        await reply.end()
        return "ok" if upstream.status < 400 else "client_error"

    async def models(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models (or /v1/models/ID) from the best eligible decode (another one if it
        does not answer)."""
        excluded: set[Instance] = set()
        timeout = aiohttp.ClientTimeout(total=self._settings.connect_timeout_s * 2)
        for _ in range(self._settings.max_attempts):
            record = choose(
                self._table.records(),
                "decode",
                self._clock(),
                self._settings.liveness,
                frozenset(excluded),
            )
            if record is None:
                break
            where = host_port(record.instance.host, record.instance.http_port)
            try:
                url = f"http://{where}{request.rel_url.raw_path}"
                async with self._session.get(url, timeout=timeout) as up:
                    payload = await up.read()
                    if up.status < 500:
                        headers = returned_headers(up.headers)
                        return web.Response(status=up.status, body=payload, headers=headers)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("decode %s: /v1/models failed: %s", where, exc or type(exc).__name__)
            excluded.add(record.instance)
        return error_response(503, "no ready decode instance answered /v1/models", retry=True)


def _give_up(failures: list[Failure], reason: str, reply: Reply, rid: str) -> Outcome:
    """Answer that no attempt succeeded (`give_up_status`), naming the request as the workers'
    answers do (`X-Request-Id`: the client's id, or the one the router made)."""
    outcome: Outcome
    if give_up_status(failures) == 502:
        status, message, outcome = 502, failures[-1].message, "upstream_error"
    else:
        last = f"; last failure: {failures[-1].message}" if failures else ""
        message = f"no instance pair can take the request: {reason}{last}"
        status, outcome = 503, "unavailable"
    _, headers, body = json_answer(
        status, error_body(message, "server_error"), retry_after_s=RETRY_AFTER_S
    )
    reply.answer(status, [*headers, (REQUEST_ID_HEADER, rid)], body)
    return outcome
