"""Stub workers and an in-process router for the router's HTTP tests, all on 127.0.0.1.

A `StubWorker` serves what a serving rank serves to the router: `/status` (built with the
shared builder), `/ready`, and the OpenAI paths, which answer as its `mode` says (`trickle`:
`trickle_events` events `gap_s` apart, then [DONE]). Tests change its fields while it runs
(the next poll reports them; `status_hangs`: /status answers nothing while set). `routed`
starts stubs and a router that polls them quickly; `wait_until` waits on a condition with a
deadline (never a sleep); `stub_process` runs a stub in a process of its own (to SIGSTOP it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from dsv4_common.api import RankCapacity
from dsv4_common.api.names import WorkerRole
from dsv4_common.api.rank_config import Instance
from dsv4_common.api.worker_status import Load, WorkerStatus, build_worker_status
from dsv4_router.config import RoleTargets, RouterSettings
from dsv4_router.serve import Listening, start_router

T = TypeVar("T")
DEADLINE_S: Final = 15.0  # generous: the tests must pass on a loaded 2-core machine
TEST_TIMEOUT_S: Final = 60.0
STUB: Final = Path(__file__).with_name("stub_process.py")

Mode = Literal[
    "json",
    "stream",
    "fail503",
    "fail502",
    "bad400",
    "hang_before",
    "hang_mid",
    "break_mid",
    "trickle",
]

STREAM_EVENTS: Final = (
    b'data: {"id":"cmpl-s","object":"text_completion","choices":[{"index":0,"text":"Hel"}]}\n\n',
    b'data: {"id":"cmpl-s","object":"text_completion","choices":[{"index":0,"text":"lo"}]}\n\n',
    b'data: {"id":"cmpl-s","object":"text_completion","choices":[{"index":0,"text":"!",'
    b'"finish_reason":"length"}]}\n\n',
    b"data: [DONE]\n\n",
)


def trickle_event(i: int) -> bytes:
    choice = {"index": 0, "text": str(i)}
    doc = {"id": "cmpl-t", "object": "text_completion", "choices": [choice]}
    return f"data: {json.dumps(doc)}\n\n".encode()


JSON_ANSWER: Final = {
    "id": "cmpl-j",
    "object": "text_completion",
    "choices": [{"index": 0, "text": "Hello!", "finish_reason": "length"}],
}
BAD_REQUEST: Final = {
    "error": {"message": "max_tokens: must be >= 1", "type": "invalid_request_error"},
    "param": "max_tokens",
}
ROUTE_KEY: Final = b"router-support-route-key-0123456789abcdef"  # the deployment's PD secret
MODELS: Final = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
_kv_ports = itertools.count(41000)


@dataclass
class Seen:
    path: str
    body: bytes
    prefill: str | None  # the X-DSV4-Prefill header
    request_id: str | None = None  # the X-Request-Id header
    authorization: str | None = None  # the Authorization header
    prefill_auth: str | None = None  # the X-DSV4-Prefill-Auth header (the router's signature)


@dataclass
class StubWorker:
    role: WorkerRole
    mode: Mode = "json"
    load: Load = field(default_factory=lambda: Load(8000, 1000, 16, 0, 0, True))
    kv_ready: bool = True
    ready: bool = True
    status_valid: bool = True  # False: /status serves a document that does not parse
    status_hangs: bool = False  # True: /status answers nothing until it turns False again
    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends `hang_before`
    gap_s: float = 0.05  # `trickle`: between events
    trickle_events: int = 20
    kv_port: int = field(default_factory=lambda: next(_kv_ports))
    # Set: /status and the API want `Authorization: Bearer <api_key>` (401 otherwise).
    api_key: str | None = None
    seen: list[Seen] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    http_port: int = 0
    status_port: int = 0
    _runner: web.AppRunner | None = None
    _api_site: web.TCPSite | None = None

    @property
    def instance(self) -> Instance:
        return Instance("127.0.0.1", self.http_port, self.status_port, self.kv_port)

    @property
    def kv_address(self) -> str:
        return f"127.0.0.1:{self.kv_port}"

    def set_load(self, **changes: Any) -> None:
        self.load = replace(self.load, **changes)

    def status_doc(self) -> dict[str, Any]:
        status = WorkerStatus(
            role=self.role,
            pp_rank=0,
            capacity=RankCapacity(
                full_tokens=8192, swa_tokens=1024, max_running_requests=16, max_context_tokens=4096
            ),
            kv_backend="zmq",
            kv_ready=self.kv_ready,
            kv_endpoint=self.kv_address,
            load=self.load,
        )
        doc = build_worker_status(status)
        if not self.status_valid:
            doc["load"]["free_full_tokens"] = "lots"
        return doc

    async def start(self) -> None:
        app = web.Application(middlewares=[self._check_key])
        app.router.add_get("/status", self._status)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._api_site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await self._api_site.start()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.http_port = self._runner.addresses[0][1]
        self.status_port = self._runner.addresses[1][1]

    async def close_api(self) -> None:
        """Stop listening on the API port (it refuses connections); /status goes on."""
        assert self._api_site is not None
        await self._api_site.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        wanted = None if self.api_key is None else f"Bearer {self.api_key}"
        given = request.headers.get("Authorization")
        if wanted is not None and request.path != "/ready" and given != wanted:
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _status(self, _: web.Request) -> web.Response:
        while self.status_hangs:
            await asyncio.sleep(0.01)
        return web.json_response(self.status_doc())

    async def _ready(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(MODELS)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        headers = request.headers
        self.seen.append(
            Seen(
                request.path,
                await request.read(),
                headers.get("X-DSV4-Prefill"),
                headers.get("X-Request-Id"),
                headers.get("Authorization"),
                headers.get("X-DSV4-Prefill-Auth"),
            )
        )
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            self.disconnected.set()
            raise

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "json":
            return web.json_response(JSON_ANSWER)
        if self.mode == "bad400":
            return web.json_response(BAD_REQUEST, status=400)
        if self.mode in ("fail503", "fail502"):
            status = 503 if self.mode == "fail503" else 502
            body = {"error": {"message": f"stub says {status}", "type": "server_error"}}
            return web.json_response(body, status=status)
        if self.mode == "hang_before":
            await self.release.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "trickle":
            for i in range(self.trickle_events):
                if i:
                    await asyncio.sleep(self.gap_s)
                await response.write(trickle_event(i))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        for event in STREAM_EVENTS:
            await response.write(event)
            if self.mode == "hang_mid":
                await asyncio.Event().wait()
            if self.mode == "break_mid":  # the connection drops inside the chunked body
                assert request.transport is not None
                request.transport.close()
                return response
            await asyncio.sleep(0.01)  # separate chunks on the wire
        await response.write_eof()
        return response


@dataclass
class Harness:
    client: aiohttp.ClientSession
    url: str
    listening: Listening

    async def post(
        self,
        body: bytes | dict[str, Any],
        path: str = "/v1/completions",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes, dict[str, str]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with self.client.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.read(), dict(resp.headers)

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.client.get(self.url + path) as resp:
            return resp.status, await resp.read()

    async def instances(self) -> list[dict[str, Any]]:
        status, body = await self.get("/instances")
        assert status == 200
        views: list[dict[str, Any]] = json.loads(body)
        return views

    async def state_of(self, worker: StubWorker) -> str:
        for view in await self.instances():
            if view["role"] == worker.role and view["http_port"] == worker.http_port:
                return str(view["state"])
        raise AssertionError(f"the router does not list {worker.role} {worker.http_port}")

    async def wait_state(self, state: str, *workers: StubWorker) -> None:
        async def reached() -> bool:
            return all([await self.state_of(w) == state for w in workers])

        await wait_until(reached, f"{state}: {[w.http_port for w in workers]}")

    async def metric(self, name: str, **labels: str) -> float:
        _, text = await self.get("/metrics")
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        raise AssertionError(f"no sample {name}{labels} in /metrics")


async def wait_until(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = DEADLINE_S
) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def settings_for(
    prefills: list[StubWorker], decodes: list[StubWorker], **overrides: Any
) -> RouterSettings:
    roles = {
        "prefill": RoleTargets(instances=tuple(w.instance for w in prefills)),
        "decode": RoleTargets(instances=tuple(w.instance for w in decodes)),
    }
    base = RouterSettings(
        host="127.0.0.1",
        port=0,
        status_port=None,
        roles=roles,  # type: ignore[arg-type]
        poll_interval_s=0.05,
        stale_after_s=30.0,  # freshness has its own pure tests; a loaded machine is slow
        status_timeout_s=5.0,
        shutdown_timeout_s=1.0,
        route_key=ROUTE_KEY,
    )
    return replace(base, **overrides)


@asynccontextmanager
async def routed(
    prefills: list[StubWorker],
    decodes: list[StubWorker],
    *,
    wait_eligible: bool = True,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """Stubs started, a router in front of them, and (by default) every stub eligible."""
    workers = [*prefills, *decodes]
    try:
        for worker in workers:
            await worker.start()
        settings = settings_for(prefills, decodes, **overrides)
        credential = settings.auth.credential()  # the harness's own requests carry the key
        headers = {"Authorization": credential} if credential is not None else None
        async with (
            start_router(settings) as listening,
            aiohttp.ClientSession(headers=headers) as client,
        ):
            harness = Harness(client, f"http://127.0.0.1:{listening.api_port}", listening)
            if wait_eligible:
                await harness.wait_state("eligible", *workers)
            yield harness
    finally:
        for worker in workers:
            await worker.stop()


def run_async(test: Callable[[], Coroutine[Any, Any, T]]) -> Callable[[], T]:
    """A plain pytest test from an async one, failing (not hanging) past TEST_TIMEOUT_S."""

    def run() -> T:
        async def bounded() -> T:
            async with asyncio.timeout(TEST_TIMEOUT_S):
                return await test()

        return asyncio.run(bounded())

    run.__name__ = test.__name__
    run.__doc__ = test.__doc__
    return run


@contextlib.contextmanager
def stub_process(role: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], Instance]]:
    """`stub_process.py ROLE *args` running, and its instance; resumed and ended on exit."""
    proc = subprocess.Popen(
        [sys.executable, str(STUB), role, *args], stdout=subprocess.PIPE, text=True, cwd=STUB.parent
    )
    try:
        assert proc.stdout is not None
        doc = json.loads(proc.stdout.readline())  # the stub prints its instance, then serves
        yield proc, Instance(doc["host"], doc["http_port"], doc["status_port"], doc["kv_port"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
