"""The worker's HTTP API (aiohttp): OpenAI-compatible completions and chat completions
(streaming over SSE), models, health, readiness, the `/status` document and `/metrics`.

Errors: a malformed body or a bad field -> 400 naming the field; a full queue -> 503 with
Retry-After; so does a draining worker (after SIGTERM: code `draining`, `drain`); every
error body is OpenAI's shape and the HTTP rules (body size and timeouts, connection bound;
`dsv4_router.http_guard`, served with its `make_runner`) hold on both apps.
A client that disconnects (streaming or not) cancels its handler, which aborts its request:
the engine frees its pages at its next turn. No response header is sent before the first
token, so a request that fails before it because of its PD prefill side gets a plain 502 the
router can retry with another prefill. A PD decode worker takes the prefill instance from the
`X-DSV4-Prefill` header, only when `X-DSV4-Prefill-Auth` carries the router's signature of it
(`dsv4_common.api.pd_secret.check_route`; else 403 naming the header): a client cannot make a
decode dial a prefill of its choosing.

A request that fails alone (`engine.failures`; or its answer cannot be written) is a 500 with
an OpenAI code (`internal_error`, `sampling_failed`), or an error event once its stream has
begun; its engine requests are aborted. `/live` and `/health` answer 503 once the engine can
serve no more (its thread died, a PP stage or the PD agent was lost): the kubelet and
`dsv4 up` restart the worker on that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from dsv4_common.api.http_rules import HttpLimits, error_document
from dsv4_common.api.lifecycle import DRAIN_CODE
from dsv4_common.api.pd_secret import PREFILL_AUTH_HEADER, PREFILL_HEADER, check_route
from dsv4_common.api.request_id import (
    MAX_FORWARDED_ID_CHARS,
    REQUEST_ID_HEADER,
    InvalidRequestId,
    choice_id,
    request_id_of,
)
from dsv4_common.api.worker_status import Load, WorkerStatus, build_worker_status
from dsv4_router.http_guard import guarded_app, json_error, read_json
from dsv4_worker.engine.failures import INTERNAL_CODE
from dsv4_worker.server.admission import RETRY_AFTER_S, SHED_REASONS
from dsv4_worker.server.answer import Answer, Choice
from dsv4_worker.server.api_options import IGNORED_FIELDS_HEADER, ApiOptions, shown_fields
from dsv4_worker.server.drain import REFUSED, Drain
from dsv4_worker.server.generation import choice_params
from dsv4_worker.server.metrics import Metrics
from dsv4_worker.server.protocol import (
    CompletionRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from dsv4_worker.server.runner import (
    DUPLICATE_CODE,
    ENGINE_DEAD_CODE,
    REFUSED_CODE,
    Done,
    DuplicateRequest,
    EngineRunner,
    Handle,
    Snapshot,
    Token,
)
from dsv4_worker.server.tokenizer import Tokenizer

log = logging.getLogger(__name__)
UNSIGNED_PREFILL_CODE = "unsigned_prefill"


@dataclass(frozen=True, slots=True)
class KVState:
    """The PD transfer side of /status, read live."""

    ready: bool = False
    layout_hash: str | None = None
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class ServeInfo:
    model_name: str  # what the model is (its preset, or its directory's name)
    vocab_size: int
    max_context_tokens: int
    status: WorkerStatus  # realized capacity (what /status reports), without live fields
    page_size: int = 1
    kv_state: Callable[[], KVState] | None = None
    served_model_names: tuple[str, ...] = ()  # the names `model` may give (default: model_name)
    created_s: int = field(default_factory=lambda: int(time.time()))
    drain: Drain = field(default_factory=Drain)  # set at SIGTERM (`serve`); the apps read it
    api: ApiOptions = field(default_factory=ApiOptions)  # defaults of the OpenAI API
    # PD decode: the deployment's secret, which signs the router's `X-DSV4-Prefill` (None: the
    # header is not read, as on a colocated worker)
    route_key: bytes | None = field(default=None, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The names requests may use; the first is the one answers carry by default."""
        return self.served_model_names or (self.model_name,)


def model_card(info: ServeInfo, name: str) -> dict[str, Any]:
    """One entry of /v1/models (vLLM's fields: its maximum context as `max_model_len`)."""
    return {
        "id": name,
        "object": "model",
        "created": info.created_s,
        "owned_by": "dsv4-serve",
        "root": info.model_name,
        "parent": None,
        "max_model_len": info.max_context_tokens,
    }


def live_status(
    info: ServeInfo,
    snap: Snapshot,
    accepting: bool,
    queued: int | None = None,
    max_queue_requests: int = 0,
) -> WorkerStatus:
    """The /status document now: realized capacity, what is free, the queue (its depth:
    `queued`, else the snapshot's waiting) and the transfer state."""
    free = {u.pool: u.free for u in snap.usage}
    load = Load(
        free_full_tokens=free.get("full", 0) * info.page_size,
        free_swa_tokens=free.get("swa", 0) * info.page_size,
        free_request_slots=free.get("req_slots", 0),
        running=snap.running,
        waiting=snap.waiting if queued is None else queued,
        max_queue_requests=max_queue_requests,
        accepting=accepting and not info.drain.draining,
        draining=info.drain.draining,
    )
    status = dataclasses.replace(info.status, load=load)
    if info.kv_state is not None:
        kv = info.kv_state()
        status = dataclasses.replace(
            status, kv_ready=kv.ready, kv_layout_hash=kv.layout_hash, kv_endpoint=kv.endpoint
        )
    return status


Parser = Callable[..., CompletionRequest]


def build_app(
    runner: EngineRunner,
    tok: Tokenizer,
    info: ServeInfo,
    metrics: Metrics | None = None,
    limits: HttpLimits | None = None,
) -> web.Application:
    """The API with the probes on the same port (the quick form)."""
    metrics = metrics or Metrics(runner.snapshot, health=lambda: runner.health())
    app = guarded_app(limits or HttpLimits(), logger=log)

    def completion_handler(
        parse: Parser, chat: bool
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                rid = request_id_of(request.headers.get(REQUEST_ID_HEADER), MAX_FORWARDED_ID_CHARS)
            except InvalidRequestId as exc:
                return json_error(400, str(exc), param=REQUEST_ID_HEADER, code="invalid_request_id")
            prefill = request.headers.get(PREFILL_HEADER) if info.route_key else None
            if prefill is not None and info.route_key is not None:
                signature = request.headers.get(PREFILL_AUTH_HEADER)
                why = check_route(info.route_key, rid, prefill, signature, time.time())
                if why is not None:
                    return json_error(403, why, param=PREFILL_HEADER, code=UNSIGNED_PREFILL_CODE)
            # Refusals that need no body first: a shed costs no JSON parse and no tokenizing
            # (under a 503 storm those compete with the engine thread). A 1-token request is
            # the easiest to admit, so when even it is shed, every request is.
            if info.drain.draining:
                return json_error(503, REFUSED, code=DRAIN_CODE, retry_after_s=RETRY_AFTER_S)
            if not runner.alive:
                why = runner.failure
                metrics.shed.labels(ENGINE_DEAD_CODE).inc()
                return json_error(
                    503,
                    "the engine is not running" + (f": {why}" if why else ""),
                    code=ENGINE_DEAD_CODE,
                    retry_after_s=RETRY_AFTER_S,
                )
            verdict = runner.admission(1)
            if verdict.admitted:
                try:
                    req = parse(
                        await read_json(request),
                        tok,
                        vocab_size=info.vocab_size,
                        max_context_tokens=info.max_context_tokens,
                        models=info.names,
                        options=info.api,
                    )
                except RequestError as exc:
                    return json_error(exc.status, str(exc), param=exc.field or None, code=exc.code)
                if req.ignored:
                    log.info("request %s: ignored fields: %s", rid, shown_fields(req.ignored))
                need_tokens = max(len(p.ids) for p in req.prompts) + req.params.max_new_tokens
                verdict = runner.admission(need_tokens)
            if not verdict.admitted:  # shed at once: 503 + Retry-After, never a queue past bound
                assert verdict.reason is not None
                metrics.shed.labels(verdict.reason).inc()
                return json_error(
                    503, verdict.message, code=verdict.reason, retry_after_s=RETRY_AFTER_S
                )
            answer = Answer(tok, req, info.names[0], chat, rid)
            loop = asyncio.get_running_loop()
            handles: list[Handle] = []
            try:
                for c in answer.choices:  # one engine request per choice
                    params = choice_params(req.params, c.index % req.gen.n)
                    engine_rid = choice_id(rid, c.index, len(answer.choices))
                    handle = runner.submit(
                        c.prompt.ids,
                        params,
                        loop,
                        prefill=prefill,
                        rid=engine_rid,
                        first_token_ahead=req.stream,  # a stream shows it at once (PD decode)
                    )
                    handles.append(handle)
            except DuplicateRequest as exc:
                for h in handles:
                    runner.abort(h)
                return json_error(409, str(exc), param=REQUEST_ID_HEADER, code=DUPLICATE_CODE)
            for c in answer.choices:
                metrics.prompt_tokens.inc(len(c.prompt.ids))
            call = _Call(runner, tuple(handles), answer, metrics)
            try:
                with info.drain.track(call.handles):
                    if req.stream:
                        response = await _stream(request, call)
                    else:
                        response = await _complete(call)
                if not response.prepared:  # a stream's head already carries them
                    response.headers[REQUEST_ID_HEADER] = rid
                    if req.ignored:
                        response.headers[IGNORED_FIELDS_HEADER] = shown_fields(req.ignored)
                return response
            except (asyncio.CancelledError, ConnectionResetError):
                for h in handles:
                    runner.abort(h)  # the client went away: free its pages now
                raise
            except Exception as exc:  # a bug answering it: this request fails alone
                for h in handles:
                    runner.abort(h)
                log.exception("request %s: answering it failed", rid)
                return json_error(500, f"internal error: {exc!r}", code=INTERNAL_CODE)

        return handle

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [model_card(info, name) for name in info.names]}
        )

    async def model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in info.names:
            return json_error(
                404, f"the model `{name}` does not exist", param="model", code="model_not_found"
            )
        return web.json_response(model_card(info, name))

    app.router.add_post("/v1/completions", completion_handler(parse_completion, chat=False))
    app.router.add_post("/v1/chat/completions", completion_handler(parse_chat, chat=True))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    _add_probes(app, runner, info, metrics)
    return app


def build_status_app(
    runner: EngineRunner, info: ServeInfo, metrics: Metrics, limits: HttpLimits | None = None
) -> web.Application:
    """The probes alone, for the status port of a deployed worker."""
    app = guarded_app(limits or HttpLimits(), logger=log, probes_only=True)
    _add_probes(app, runner, info, metrics)
    return app


def _add_probes(
    app: web.Application, runner: EngineRunner, info: ServeInfo, metrics: Metrics
) -> None:
    async def live(_: web.Request) -> web.Response:
        """200 while the engine can serve (busy or not); 503 once it never will again."""
        why = runner.failure
        if why is None:
            return web.Response(text="ok")
        return web.Response(status=503, text=f"engine not running: {why}")

    async def ready(_: web.Request) -> web.Response:
        if info.drain.draining:
            return web.Response(status=503, text=DRAIN_CODE)
        if runner.alive:
            return web.Response(text="ready")
        why = runner.failure
        return web.Response(status=503, text="engine not running" + (f": {why}" if why else ""))

    async def status(_: web.Request) -> web.Response:
        view = runner.queue_view()
        accepting = runner.alive and not runner.overloaded()
        doc = live_status(
            info, runner.snapshot(), accepting, view.waiting, runner.policy.max_queue_requests
        )
        return web.json_response(build_worker_status(doc))

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    app.router.add_get("/health", live)
    app.router.add_get("/live", live)
    app.router.add_get("/ready", ready)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics_page)


async def _events(call: _Call) -> AsyncIterator[tuple[Choice, str, Done | None]]:
    """(choice, its new text, its Done or None) per event of every choice, in order per
    choice, until every choice has ended. A choice whose stop string matched is aborted and
    ends with "stop" at once."""
    handles, choices = call.handles, call.answer.choices
    last_s: list[float | None] = [None] * len(handles)
    if len(handles) == 1:  # the common case: one queue, read directly
        while not choices[0].done:
            event = await handles[0].events.get()
            yield choices[0], _on_event(call, 0, event, last_s), _done(event)
        return
    pending: dict[asyncio.Future[Token | Done], int] = {}
    try:
        for i, h in enumerate(handles):
            pending[asyncio.ensure_future(h.events.get())] = i
        while pending:
            ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(ready, key=lambda f: pending[f]):
                i = pending.pop(fut)
                event = fut.result()
                piece = _on_event(call, i, event, last_s)
                if not choices[i].done:
                    pending[asyncio.ensure_future(handles[i].events.get())] = i
                yield choices[i], piece, _done(event)
    finally:
        for fut in pending:
            fut.cancel()


def _done(event: Token | Done) -> Done | None:
    return event if isinstance(event, Done) else None


def _on_event(call: _Call, i: int, event: Token | Done, last_s: list[float | None]) -> str:
    """Choice `i` takes its next event (and the metrics count it): the text it releases."""
    c, handle, metrics = call.answer.choices[i], call.handles[i], call.metrics
    if isinstance(event, Done):
        metrics.requests.labels(event.reason).inc()
        if event.code in SHED_REASONS:
            metrics.shed.labels(event.code).inc()
        metrics.e2e.observe(time.monotonic() - handle.submitted_s)
        # Echo alone: the one token computed may be a stop id; the answer is the prompt.
        dropped = not c.req.gen.generate and event.reason == "stop"
        c.finish_reason = "length" if dropped else event.reason
        return c.finish()
    metrics.generation_tokens.inc()
    before = last_s[i]
    if before is None:
        metrics.ttft.observe(event.at_s - handle.submitted_s)
    else:
        metrics.itl.observe(event.at_s - before)
    last_s[i] = event.at_s
    piece = c.push(event)
    if c.stopped:
        call.runner.abort(handle)
        c.finish_reason = "stop"
    return piece


@dataclass(frozen=True, slots=True)
class _Call:
    """One accepted completion request and what answering it needs: an engine request per
    choice (`handles[i]` is `answer.choices[i]`'s)."""

    runner: EngineRunner
    handles: tuple[Handle, ...]
    answer: Answer
    metrics: Metrics


async def _complete(call: _Call) -> web.Response:
    failed: Done | None = None
    async for _, _, done in _events(call):
        if done is not None and done.reason == "error" and failed is None:
            failed = done  # the request fails: the other choices stop too
            for h in call.handles:
                call.runner.abort(h)
    if failed is not None:
        started = any(c.token_ids for c in call.answer.choices)
        return _failure(failed.error, failed.retryable and not started, failed.code)
    return web.json_response(call.answer.body())


def _failure(message: str | None, retryable: bool, code: str | None = None) -> web.Response:
    """A request that failed. Retryable failures come from the PD prefill side (handshake,
    transfer, timeout): 502 + Retry-After, so the router retries with another prefill. One
    aborted by a drain: 503 + Retry-After, code `draining`."""
    if code == DRAIN_CODE:
        return json_error(503, message or REFUSED, code=code, retry_after_s=RETRY_AFTER_S)
    if code in SHED_REASONS:  # removed from the queue unscheduled: nothing was computed
        return json_error(503, message or "shed", code=code, retry_after_s=RETRY_AFTER_S)
    if code == DUPLICATE_CODE:  # its namesake still held pages here: nothing was computed
        return json_error(409, message or "duplicate", param=REQUEST_ID_HEADER, code=code)
    if code == REFUSED_CODE:  # the engine refused what the request asks: nothing was computed
        return json_error(400, message or "refused", code=code)
    body = error_document(message or "failed", "server_error", None, code)
    if retryable:
        return web.json_response(body, status=502, headers={"Retry-After": str(RETRY_AFTER_S)})
    return web.json_response(body, status=500)


async def _stream(request: web.Request, call: _Call) -> web.StreamResponse:
    answer = call.answer
    headers = {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        REQUEST_ID_HEADER: answer.request_id,
    }
    if answer.req.ignored:
        headers[IGNORED_FIELDS_HEADER] = shown_fields(answer.req.ignored)
    resp = web.StreamResponse(headers=headers)
    try:
        async for c, piece, done in _events(call):
            error = done.error if done is not None and done.reason == "error" else None
            if not resp.prepared:  # headers go with the first token: a failure before is a 5xx
                if error is not None and done is not None:
                    for h in call.handles:
                        call.runner.abort(h)
                    return _failure(error, done.retryable, done.code)
                await resp.prepare(request)
            chunk = answer.chunk(c, piece, error, None if done is None else done.code)
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    except Exception as exc:  # (not a cancellation) a bug answering it: the request fails alone
        if not resp.prepared:
            raise  # the handler answers 500
        for h in call.handles:
            call.runner.abort(h)
        log.exception("request %s: its stream failed", answer.request_id)
        doc = error_document(f"internal error: {exc!r}", "server_error", None, INTERNAL_CODE)
        await resp.write(f"data: {json.dumps(doc)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp
    if answer.req.gen.include_usage:
        await resp.write(f"data: {json.dumps(answer.usage_chunk())}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
