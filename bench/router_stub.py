"""A worker stand-in for bench/router.py that answers at once: a raw asyncio HTTP/1.1 server
on 127.0.0.1, cheap enough that the router in front of it is what a load test measures.

    python bench/router_stub.py [--stream-gap-ms MS]

Prints one JSON line `{"api": PORT, "decode_status": PORT, "prefill_status": PORT}` once it
listens, then serves until SIGTERM or SIGINT. Three ports:

- api: POST /v1/completions, /v1/chat/completions, /generate answer a fixed completion; a
  body asking `"stream": true` gets SSE (headers and the first event in one write, the other
  events and the end `--stream-gap-ms` later, so a relay that holds the first event back shows
  it). GET /health, /health_generate, /ready, /live, /v1/models, /model_info,
  /server_info (and their /get_ forms), /status answer 200 (what sglang-router asks a worker).
- decode_status, prefill_status: `/status` (a worker status document of that role, idle and
  accepting) and `/ready`, which the dsv4 router polls.

Keep-alive by default; `Connection: close` closes after the answer. Request bodies must carry
Content-Length (both routers and the load generator send it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any, Final, cast

from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import Load, WorkerStatus, build_worker_status

HOST: Final = "127.0.0.1"
MAX_HEAD_BYTES: Final = 65536
COMPLETION_PATHS: Final = frozenset({b"/v1/completions", b"/v1/chat/completions", b"/generate"})
COMPLETION: Final = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "stub",
        "choices": [{"index": 0, "text": "Hello!", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }
).encode()
_TEXTS: Final = (("Hel", None), ("lo", None), ("!", "length"))
EVENTS: Final = (
    *(
        b"data: %s\n\n"
        % json.dumps(
            {
                "id": "cmpl-s",
                "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            },
            separators=(",", ":"),
        ).encode()
        for text, finish in _TEXTS
    ),
    b"data: [DONE]\n\n",
)
MODELS: Final = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]})
INFO: Final = json.dumps({"model_path": "stub", "is_generation": True})


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: str, content_type: bytes, body: bytes, close: bool = False) -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        status.encode(),
        content_type,
        len(body),
    )
    return head + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body


JSON: Final = b"application/json"
STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
STREAM_FIRST: Final = STREAM_HEAD + _chunk(EVENTS[0])
STREAM_REST: Final = b"".join(_chunk(e) for e in EVENTS[1:]) + b"0\r\n\r\n"


def status_document(role: str) -> bytes:
    status = WorkerStatus(
        role=role,  # type: ignore[arg-type]
        pp_rank=0,
        capacity=RankCapacity(
            full_tokens=1 << 20,
            swa_tokens=1 << 16,
            max_running_requests=4096,
            max_context_tokens=8192,
        ),
        kv_backend="zmq",
        kv_ready=True,
        kv_endpoint=f"{HOST}:1",
        load=Load(1 << 20, 1 << 16, 4096, 0, 0, True),
    )
    return json.dumps(build_worker_status(status)).encode()


def answers(role: str) -> dict[bytes, bytes]:
    """GET path -> the whole keep-alive response."""
    ok = _response("200 OK", b"text/plain", b"ok\n")
    return {
        b"/status": _response("200 OK", JSON, status_document(role)),
        b"/ready": ok,
        b"/live": ok,
        b"/health": ok,
        b"/health_generate": ok,
        b"/v1/models": _response("200 OK", JSON, MODELS.encode()),
        b"/model_info": _response("200 OK", JSON, INFO.encode()),
        b"/server_info": _response("200 OK", JSON, INFO.encode()),
        b"/get_model_info": _response("200 OK", JSON, INFO.encode()),
        b"/get_server_info": _response("200 OK", JSON, INFO.encode()),
    }


class StubProtocol(asyncio.Protocol):
    """One client connection: parse requests one after another, answer each at once."""

    def __init__(self, gets: dict[bytes, bytes], stream_gap_s: float) -> None:
        self._gets = gets
        self._gap_s = stream_gap_s
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._streaming = False  # an SSE answer is half sent: later requests wait for it
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._serve()

    def _serve(self) -> None:
        while self._transport is not None and not self._streaming:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    self._transport.close()
                return
            lines = self._buf[:end].split(b"\r\n")
            words = lines[0].split(b" ")
            if len(words) != 3 or not words[2].startswith(b"HTTP/1."):  # e.g. an HTTP/2 preface
                self._transport.write(_response("400 Bad Request", JSON, b"{}", close=True))
                self._transport.close()
                return
            method, path = words[0], words[1]
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
                elif name == b"transfer-encoding":
                    self._transport.write(_response("501 Not Implemented", JSON, b"{}", True))
                    self._transport.close()
                    return
            if len(self._buf) < end + 4 + length:
                return
            body = self._buf[end + 4 : end + 4 + length]
            self._buf = self._buf[end + 4 + length :]
            self._answer(method, path.partition(b"?")[0], body, close)

    def _answer(self, method: bytes, path: bytes, body: bytes, close: bool) -> None:
        transport = self._transport
        assert transport is not None
        if method == b"POST" and path in COMPLETION_PATHS:
            if b'"stream":true' in body or b'"stream": true' in body:
                transport.write(STREAM_FIRST)
                self._streaming = True
                self._loop.call_later(self._gap_s, self._finish_stream, close)
                return
            transport.write(_response("200 OK", JSON, COMPLETION, close))
        elif method == b"GET" and path in self._gets and not close:
            transport.write(self._gets[path])
        elif method == b"GET" and path in self._gets:
            transport.write(
                self._gets[path].replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
            )
        else:
            transport.write(_response("404 Not Found", JSON, b'{"error":"no such path"}', close))
        if close:
            transport.close()

    def _finish_stream(self, close: bool) -> None:
        self._streaming = False
        if self._transport is None:
            return
        self._transport.write(STREAM_REST)
        if close:
            self._transport.close()
            return
        self._serve()


async def serve(stream_gap_s: float, ready: Callable[[dict[str, int]], None]) -> None:
    loop = asyncio.get_running_loop()
    ports: dict[str, int] = {}
    servers = []
    for name, role in (
        ("api", "decode"),
        ("decode_status", "decode"),
        ("prefill_status", "prefill"),
    ):
        gets = answers(role)
        server = await loop.create_server(
            lambda gets=gets: StubProtocol(gets, stream_gap_s),  # type: ignore[misc]
            HOST,
            0,
            backlog=1024,
        )
        servers.append(server)
        ports[name] = server.sockets[0].getsockname()[1]
    ready(ports)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed (the stub must not be the bottleneck)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: Any = uvloop.new_event_loop()
    return loop  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-gap-ms", type=float, default=2.0)
    args = parser.parse_args()

    def ready(ports: dict[str, int]) -> None:
        print(json.dumps(ports), flush=True)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve(args.stream_gap_ms / 1000, ready))


if __name__ == "__main__":
    main()
