"""The router's HTTP surface (aiohttp): the OpenAI API in front of prefill/decode pairs, plus
probes, metrics and a view of the instances.

Routing rules:

- Eligible instance: it is live (a `/status` parsed, and not `stale_after_misses` probes
  in a row missed over the grace: `liveness`), its last `/ready` answered 200, it reports the
  role it is listed under, `load.accepting` is true, its queue is not full (`load.waiting`, or
  the router's own requests open there beyond its running slots, below
  `load.max_queue_requests`: `choice.queue_full`), and (decode) `kv_ready` is true.
  Discovery probes every instance every `poll_interval_s`.
- Pair: the prefill with the fewest queued requests (its `waiting` plus the router's requests
  sent since that status), then the most free full tokens; the decode with the most free full
  tokens less one average request share (full tokens / request slots) per such pending
  request, then the fewest running. Ties go to the lowest address.
- Forwarding: the client's exact body goes to the decode's API at the same path, with
  `X-DSV4-Prefill: <prefill host>:<prefill KV port>`; the decode worker fetches the KV itself
  and answers as an OpenAI server. Its status and body come back unchanged (4xx included,
  never retried); `text/event-stream` answers are relayed chunk by chunk as they arrive.
- Retry: while the client has no byte yet, a failed attempt excludes instances for this
  request and the next best pair is tried (at most `max_attempts`): no answer (connection
  failed, or no headers within `first_byte_timeout_s`) or 503 excludes the decode, 502 (the
  decode could not use the prefill) excludes the prefill, another 5xx excludes both.
- Giving up: 503 with `Retry-After: 1` saying why (no ready prefill or decode, every ready
  one busy or failed), at once, counted by `dsv4_router_shed_requests{reason}`; 502 with
  the decode's message when the last attempt got a 5xx other than 503.
- Mid-stream: an upstream that breaks ends the stream with an SSE error event (code
  `upstream_broken`); a client that disconnects cancels its handler, which closes the upstream
  connection at once (the decode worker aborts the request and frees its pages).
- A frozen decode (`liveness.frozen_reason`: no byte for `stall_after_s` of the router's own
  progress and its latest status probe missed; a slow decode answers its probes): its open
  streams end with an error event (code `upstream_stalled`) and `[DONE]`; a request with no
  byte sent yet is retried on another pair as above, or, with none free, waits while the
  decode is in its grace (it may only be starved) and gets a 503 once it is stale.
- Bad requests never reach a worker: the body is read and checked by the shared HTTP rules
  (`http_guard.read_json`: 400 naming the field, 408, 413); every error body is OpenAI's
  shape, 404 and 405 included. Connections follow `settings.http` (timeouts, a bound).
- A client that disconnects from a non-streaming request cancels its handler too, which
  closes the upstream connection while decode has not answered: the worker aborts it.
- Draining (SIGTERM, `drain`): the listeners stay open, `/ready` answers 503 `draining` and
  new completions 503 + Retry-After (code `draining`); open ones get `shutdown_timeout_s`,
  then a stream ends with an error event (code `draining`) and `[DONE]`, a request with no
  byte sent a 503.
- Completions are mostly read and answered by `fast_path` (a plain request on a connection
  it holds), the rest by aiohttp's routes here; both answer them alike (`fast_completion`,
  the aiohttp route: the drain's 503, `_complete`).
- `/ready` is 200 iff at least one prefill and one decode are eligible, and (several router
  processes, `processes`) every process saw such a pair in its last discovery round, so a
  client whose connection lands on any of them is served. `/live`, `/ready`,
  `/health`, `/metrics`, `/instances` and `/status` (JSON: readiness, every instance and its
  state, the settings; `views.router_status`) are also served on the status port.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from dsv4_common.api.http_rules import BodyError, error_document, parse_json_body
from dsv4_common.api.lifecycle import DRAIN_CODE
from dsv4_router.busy_poll import BusyPoll
from dsv4_router.choice import InstanceTable, choose_pair, unavailable_reason
from dsv4_router.config import RouterSettings
from dsv4_router.drain import CUT, REFUSED, RouterDrain
from dsv4_router.errors import RETRY_AFTER_S, json_answer
from dsv4_router.http_guard import (
    body_error_response,
    guarded_app,
    read_body,
)
from dsv4_router.metrics import CONTENT_TYPE, RouterMetrics
from dsv4_router.proxy import Proxy
from dsv4_router.reply import Incoming, Reply, WebReply
from dsv4_router.views import instance_view, router_status

# Each client connection of the API may hold one upstream connection too.
FDS_PER_CONNECTION: Final = 2
COMPLETION_PATHS: Final = ("/v1/completions", "/v1/chat/completions")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterState:
    settings: RouterSettings
    table: InstanceTable
    metrics: RouterMetrics
    proxy: Proxy
    clock: Callable[[], float]
    process: int = 0  # which of the router's processes this is (`processes`)
    drain: RouterDrain = field(default_factory=RouterDrain)  # set at SIGTERM (`serve`)
    busy_poll: BusyPoll = field(default_factory=lambda: BusyPoll(0.0))  # the process's (`serve`)


def build_api_app(state: RouterState) -> web.Application:
    """The API port: completions, models, probes, metrics and /instances (aiohttp's routes;
    most completions come by `fast_completion` instead: `fast_path`)."""
    app = build_probe_app(state, probes_only=False)

    async def completion(request: web.Request) -> web.StreamResponse:
        reply = WebReply(request)
        if not _refused_while_draining(state, reply):
            with state.drain.track():
                try:
                    body = await read_body(request)  # the worker gets the exact bytes
                except BodyError as exc:
                    state.metrics.count("client_error")
                    return body_error_response(exc)
                incoming = Incoming(
                    request.method, request.raw_path, request.path, request.raw_headers, body
                )
                await _complete(state, incoming, reply)
        assert reply.response is not None, "every completion is answered"
        return reply.response

    async def models(request: web.Request) -> web.StreamResponse:
        return await state.proxy.models(request)

    for path in COMPLETION_PATHS:
        app.router.add_post(path, completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", models)  # one model: the decode answers
    return app


async def fast_completion(state: RouterState, incoming: Incoming, reply: Reply) -> None:
    """A completion from `fast_path` (its body in, within the size limit): as aiohttp's
    route answers it."""
    if not _refused_while_draining(state, reply):
        with state.drain.track():
            await _complete(state, incoming, reply)


def _refused_while_draining(state: RouterState, reply: Reply) -> bool:
    """A draining router refuses new completions: 503 + Retry-After, counted."""
    if not state.drain.draining:
        return False
    state.metrics.count("unavailable")
    document = error_document(REFUSED, "server_error", code=DRAIN_CODE)
    reply.answer(*json_answer(503, document, retry_after_s=RETRY_AFTER_S))
    return True


async def _complete(state: RouterState, incoming: Incoming, reply: Reply) -> None:
    """Check the body (400 naming the field), then route it (`proxy`); a request the drain
    cut before any byte was sent gets a 503 (a stream that had started ended with an error
    event in `proxy`)."""
    try:
        parse_json_body(incoming.body, max_depth=state.settings.http.max_depth)
    except BodyError as exc:
        state.metrics.count("client_error")
        reply.answer(*json_answer(exc.status, exc.document()))
        return
    try:
        await state.proxy.completion(incoming, reply)
    except asyncio.CancelledError:
        if not state.drain.was_cut() or reply.started:
            raise
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()
        state.metrics.count("unavailable")
        document = error_document(CUT, "server_error", code=DRAIN_CODE)
        reply.answer(*json_answer(503, document, retry_after_s=RETRY_AFTER_S))


def build_probe_app(state: RouterState, *, probes_only: bool = True) -> web.Application:
    """The status port: liveness, readiness, metrics, /instances and /status."""
    app = guarded_app(
        state.settings.http,
        fds_per_connection=FDS_PER_CONNECTION,
        logger=log,
        probes_only=probes_only,
    )

    async def live(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def ready(_: web.Request) -> web.Response:
        if state.drain.draining:
            return web.Response(status=503, text=f"{DRAIN_CODE}\n")
        records, now_s = state.table.records(), state.clock()
        if choose_pair(records, now_s, state.settings.liveness) is not None:
            if state.metrics.every_process_ready():
                return web.Response(text="ready\n")
            return web.Response(
                status=503, text="not ready: another router process sees no pair yet\n"
            )
        reason = unavailable_reason(records, now_s, state.settings.liveness)
        return web.Response(status=503, text=f"not ready: {reason}\n")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def instances(_: web.Request) -> web.Response:
        now_s = state.clock()
        views = [instance_view(r, now_s, state.settings.liveness) for r in state.table.records()]
        return web.json_response(views, dumps=lambda v: json.dumps(v, indent=2))

    async def status(_: web.Request) -> web.Response:
        doc = router_status(
            state.table.records(), state.clock(), state.settings, process=state.process
        )
        return web.json_response(doc, dumps=lambda v: json.dumps(v, indent=2))

    app.router.add_get("/live", live)
    app.router.add_get("/health", live)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/instances", instances)
    app.router.add_get("/status", status)
    return app
