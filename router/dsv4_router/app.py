"""The router's HTTP surface (aiohttp): the OpenAI API in front of prefill/decode pairs, plus
probes, metrics and a view of the instances.

Routing rules:

- Eligible instance: its last `/status` parsed and is younger than `stale_after_s`, its
  `/ready` answered 200, it reports the role it is listed under, `load.accepting` is true, and
  (decode) `kv_ready` is true. Discovery probes every instance every `poll_interval_s`.
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
  one busy or failed); 502 with the decode's message when the last attempt got a 5xx other
  than 503.
- Mid-stream: an upstream that breaks ends the stream with an SSE error event; a client that
  disconnects cancels its handler, which closes the upstream connection at once (the decode
  worker aborts the request and frees its pages).
- `/ready` is 200 iff at least one prefill and one decode are eligible. `/live`, `/ready`,
  `/health` and `/metrics` are also served on the status port (deployed form).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from dsv4_common.api.documents import to_document
from dsv4_router.choice import (
    InstanceRecord,
    InstanceTable,
    assess,
    choose_pair,
    unavailable_reason,
)
from dsv4_router.config import RouterSettings
from dsv4_router.errors import error_response
from dsv4_router.metrics import CONTENT_TYPE, RouterMetrics
from dsv4_router.proxy import Proxy

# Long prompts as token ids run to megabytes.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
COMPLETION_PATHS: Final = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class RouterState:
    settings: RouterSettings
    table: InstanceTable
    metrics: RouterMetrics
    proxy: Proxy
    clock: Callable[[], float]


def build_api_app(state: RouterState) -> web.Application:
    """The API port: completions, models, probes, metrics and /instances."""
    app = build_probe_app(state)

    async def completion(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            doc = json.loads(body)
        except ValueError as exc:
            state.metrics.count("client_error")
            return error_response(
                400, f"body is not valid JSON ({exc})", error_type="invalid_request_error"
            )
        if not isinstance(doc, dict):
            state.metrics.count("client_error")
            return error_response(
                400,
                f"body must be a JSON object, got {type(doc).__name__}",
                error_type="invalid_request_error",
            )
        return await state.proxy.completion(request, body)

    async def models(request: web.Request) -> web.StreamResponse:
        return await state.proxy.models(request)

    for path in COMPLETION_PATHS:
        app.router.add_post(path, completion)
    app.router.add_get("/v1/models", models)
    return app


def build_probe_app(state: RouterState) -> web.Application:
    """The status port: liveness, readiness, metrics and /instances."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)

    async def live(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def ready(_: web.Request) -> web.Response:
        records, now_s = state.table.records(), state.clock()
        if choose_pair(records, now_s, state.settings.stale_after_s) is not None:
            return web.Response(text="ready\n")
        reason = unavailable_reason(records, now_s, state.settings.stale_after_s)
        return web.Response(status=503, text=f"not ready: {reason}\n")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def instances(_: web.Request) -> web.Response:
        now_s = state.clock()
        views = [
            instance_view(r, now_s, state.settings.stale_after_s) for r in state.table.records()
        ]
        return web.json_response(views, dumps=lambda v: json.dumps(v, indent=2))

    app.router.add_get("/live", live)
    app.router.add_get("/health", live)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/instances", instances)
    return app


def instance_view(record: InstanceRecord, now_s: float, stale_after_s: float) -> dict[str, Any]:
    """One record for people (GET /instances)."""
    health, reason = assess(record, now_s, stale_after_s)
    status = record.status
    age_s = None if record.status_at_s is None else round(now_s - record.status_at_s, 3)
    return {
        "role": record.role,
        **to_document(record.instance),
        "state": health,
        "reason": reason or None,
        "ready": record.ready,
        "status_age_s": age_s,
        "kv_ready": None if status is None else status.kv_ready,
        "load": None if status is None else to_document(status.load),
        "router_inflight": record.inflight,
        "router_pending": record.pending,
        "error": record.error,
    }
