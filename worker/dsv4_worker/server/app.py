"""The worker's HTTP API (aiohttp): OpenAI-compatible completions and chat completions
(streaming over SSE), models, health, readiness, the `/status` document and `/metrics`.

Errors: a malformed body or a bad field -> 400 naming the field; a full queue -> 503 with
Retry-After; a client that disconnects (also mid-stream) aborts its request, whose pages the
engine frees at its next turn. No response header is sent before the first token, so a
request that fails before it because of its PD prefill side gets a plain 502 the router can
retry with another prefill. A PD decode worker takes the prefill instance from the
`X-DSV4-Prefill` header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from dsv4_common.api.worker_status import Load, WorkerStatus, build_worker_status
from dsv4_worker.server.metrics import Metrics
from dsv4_worker.server.protocol import (
    CompletionRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from dsv4_worker.server.runner import Done, EngineRunner, Handle, Snapshot, Token
from dsv4_worker.server.tokenizer import StreamDecoder, Tokenizer, find_stop, stop_holdback

RETRY_AFTER_S = 1
PREFILL_HEADER = "X-DSV4-Prefill"


@dataclass(frozen=True, slots=True)
class KVState:
    """The PD transfer side of /status, read live."""

    ready: bool = False
    layout_hash: str | None = None
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class ServeInfo:
    model_name: str
    vocab_size: int
    max_context_tokens: int
    status: WorkerStatus  # realized capacity (what /status reports), without live fields
    page_size: int = 1
    kv_state: Callable[[], KVState] | None = None


def live_status(info: ServeInfo, snap: Snapshot, accepting: bool) -> WorkerStatus:
    """The /status document now: realized capacity, what is free, and the transfer state."""
    free = {u.pool: u.free for u in snap.usage}
    load = Load(
        free_full_tokens=free.get("full", 0) * info.page_size,
        free_swa_tokens=free.get("swa", 0) * info.page_size,
        free_request_slots=free.get("req_slots", 0),
        running=snap.running,
        waiting=snap.waiting,
        accepting=accepting,
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
    runner: EngineRunner, tok: Tokenizer, info: ServeInfo, metrics: Metrics | None = None
) -> web.Application:
    """The API with the probes on the same port (the quick form)."""
    metrics = metrics or Metrics(runner.snapshot)
    app = web.Application(client_max_size=8 * 1024 * 1024)

    def error(status: int, message: str, field: str = "", retry: bool = False) -> web.Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": field}}
        headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
        return web.json_response(body, status=status, headers=headers)

    async def read_json(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError("", f"body is not valid JSON ({exc})") from exc

    def completion_handler(
        parse: Parser, chat: bool
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                req = parse(
                    await read_json(request),
                    tok,
                    vocab_size=info.vocab_size,
                    max_context_tokens=info.max_context_tokens,
                )
            except RequestError as exc:
                return error(400, str(exc), exc.field)
            if not runner.alive:
                why = runner.failure
                return error(
                    503, "the engine is not running" + (f": {why}" if why else ""), retry=True
                )
            if runner.overloaded():
                return error(503, "too many requests waiting; retry later", retry=True)
            metrics.prompt_tokens.inc(len(req.prompt_ids))
            handle = runner.submit(
                req.prompt_ids,
                req.params,
                asyncio.get_running_loop(),
                prefill=request.headers.get(PREFILL_HEADER),
            )
            try:
                call = _Call(runner, handle, req, tok, info, metrics, chat)
                if req.stream:
                    return await _stream(request, call)
                return await _complete(call)
            except (asyncio.CancelledError, ConnectionResetError):
                runner.abort(handle)  # the client went away: free its pages now
                raise

        return handle

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": info.model_name, "object": "model"}]}
        )

    app.router.add_post("/v1/completions", completion_handler(parse_completion, chat=False))
    app.router.add_post("/v1/chat/completions", completion_handler(parse_chat, chat=True))
    app.router.add_get("/v1/models", models)
    _add_probes(app, runner, info, metrics)
    return app


def build_status_app(runner: EngineRunner, info: ServeInfo, metrics: Metrics) -> web.Application:
    """The probes alone, for the status port of a deployed worker."""
    app = web.Application()
    _add_probes(app, runner, info, metrics)
    return app


def _add_probes(
    app: web.Application, runner: EngineRunner, info: ServeInfo, metrics: Metrics
) -> None:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(_: web.Request) -> web.Response:
        if runner.alive:
            return web.Response(text="ready")
        why = runner.failure
        return web.Response(status=503, text="engine not running" + (f": {why}" if why else ""))

    async def status(_: web.Request) -> web.Response:
        accepting = runner.alive and not runner.overloaded()
        return web.json_response(
            build_worker_status(live_status(info, runner.snapshot(), accepting))
        )

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    app.router.add_get("/health", health)
    app.router.add_get("/live", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics_page)


class _Output:
    """One request's tokens and text. Stop strings cut the text; while streaming, text that
    could still become a stop string (or half a UTF-8 character) is held back."""

    def __init__(self, tok: Tokenizer, req: CompletionRequest) -> None:
        self.decoder = StreamDecoder(tok)
        self.req = req
        self.full = ""  # everything decoded so far
        self.text = ""  # what the client has been given (or will be, at the end)
        self.token_ids: list[int] = []
        self.stopped = False

    def push(self, token_id: int) -> str:
        """The new text this token releases."""
        self.token_ids.append(token_id)
        self.full += self.decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request."""
        self.full += self.decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        cut = find_stop(self.full, self.req.stop_strings) if self.req.stop_strings else None
        if cut is not None:
            self.stopped = True
            end = cut
        elif final:
            end = len(self.full)
        else:
            end = len(self.full) - stop_holdback(self.full, self.req.stop_strings)
        piece = self.full[len(self.text) : max(end, len(self.text))]
        self.text += piece
        return piece


def _choice(
    out: _Output, reason: str | None, chat: bool, delta: str | None = None
) -> dict[str, Any]:
    text = out.text if delta is None else delta
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        key = "message" if delta is None else "delta"
        choice[key] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if out.req.return_token_ids and delta is None:
        choice["token_ids"] = out.token_ids
    return choice


def _envelope(handle: Handle, info: ServeInfo, chat: bool, stream: bool) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": f"cmpl-{handle.rid}",
        "object": f"{kind}.chunk" if stream and chat else kind,
        "created": int(time.time()),
        "model": info.model_name,
    }


async def _events(runner: EngineRunner, handle: Handle, out: _Output, metrics: Metrics) -> Any:
    """Yields (new text, finish reason or None) per event; stops at Done or a stop string."""
    last_s = None
    while True:
        event = await handle.events.get()
        if isinstance(event, Done):
            metrics.requests.labels(event.reason).inc()
            metrics.e2e.observe(time.monotonic() - handle.submitted_s)
            yield out.finish(), event.reason, event.error, event.retryable
            return
        assert isinstance(event, Token)
        metrics.generation_tokens.inc()
        if last_s is None:
            metrics.ttft.observe(event.at_s - handle.submitted_s)
        else:
            metrics.itl.observe(event.at_s - last_s)
        last_s = event.at_s
        piece = out.push(event.token_id)
        if out.stopped:
            runner.abort(handle)
            yield piece, "stop", None, False
            return
        yield piece, None, None, False


@dataclass(frozen=True, slots=True)
class _Call:
    """One accepted completion request and what answering it needs."""

    runner: EngineRunner
    handle: Handle
    req: CompletionRequest
    tok: Tokenizer
    info: ServeInfo
    metrics: Metrics
    chat: bool


async def _complete(call: _Call) -> web.Response:
    runner, handle, req, info, metrics, chat = (
        call.runner,
        call.handle,
        call.req,
        call.info,
        call.metrics,
        call.chat,
    )
    out = _Output(call.tok, req)
    reason, err, retryable = "length", None, False
    async for _, finish, error, retry in _events(runner, handle, out, metrics):
        if finish is not None:
            reason, err, retryable = finish, error, retry
    if reason == "error":
        return _failure(err, retryable and not out.token_ids)
    body = _envelope(handle, info, chat, stream=False)
    body["choices"] = [_choice(out, reason, chat)]
    body["usage"] = {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(req.prompt_ids) + len(out.token_ids),
    }
    return web.json_response(body)


def _failure(message: str | None, retryable: bool) -> web.Response:
    """A request that failed. Retryable failures come from the PD prefill side (handshake,
    transfer, timeout): 502 + Retry-After, so the router retries with another prefill."""
    body = {"error": {"message": message or "failed", "type": "server_error"}}
    if retryable:
        return web.json_response(body, status=502, headers={"Retry-After": str(RETRY_AFTER_S)})
    return web.json_response(body, status=500)


async def _stream(request: web.Request, call: _Call) -> web.StreamResponse:
    runner, handle, req, tok, info, metrics, chat = (
        call.runner,
        call.handle,
        call.req,
        call.tok,
        call.info,
        call.metrics,
        call.chat,
    )
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    out = _Output(tok, req)
    async for piece, finish, error, retry in _events(runner, handle, out, metrics):
        if not resp.prepared:  # headers go with the first token, so a failure before it is a 5xx
            if finish == "error" and not out.token_ids:
                return _failure(error, retry)
            await resp.prepare(request)
        chunk = _envelope(handle, info, chat, stream=True)
        chunk["choices"] = [_choice(out, finish, chat, delta=piece)]
        if req.return_token_ids and finish is not None:
            chunk["choices"][0]["token_ids"] = out.token_ids
        if error:
            chunk["error"] = {"message": error}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
