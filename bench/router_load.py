"""The load generator of bench/router.py, a process of its own: closed-loop HTTP/1.1 clients
on kept-alive connections, raw asyncio protocols (uvloop when installed), so that it is not
what limits the rate (bench/router.py measures the stub directly as the check).

    python bench/router_load.py    # then one JSON command per stdin line

A command `{"port": P, "path": "/v1/completions", "connections": C, "stream": false,
"warmup_s": W, "window_s": S}` opens C connections to 127.0.0.1:P, each sending a completion
as soon as its previous answer ended; after W seconds it counts for S seconds and prints one
JSON line: requests/s, latency percentiles and (stream) time to the first whole SSE event,
all in ms, and the number of bad answers (not 200, or a stream that does not end in [DONE]).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from typing import Any, Final, cast

from router_stub import new_event_loop

DONE: Final = b"data: [DONE]\n\n"
PROMPT: Final = "The quick brown fox jumps over the lazy dog. " * 2


def request_bytes(port: int, path: str, stream: bool, authorization: str | None = None) -> bytes:
    body = json.dumps({"model": "stub", "prompt": PROMPT, "max_tokens": 3, "stream": stream})
    credential = f"Authorization: {authorization}\r\n" if authorization else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{credential}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode()


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Recorder:
    """Completions inside the counting window."""

    def __init__(self) -> None:
        self.counting = False
        self.running = True
        self.latency_s: list[float] = []
        self.first_event_s: list[float] = []
        self.bad = 0


class LoadProtocol(asyncio.Protocol):
    """One connection: send, read the whole answer (Content-Length or chunked), send again."""

    def __init__(self, request: bytes, stream: bool, recorder: Recorder) -> None:
        self._request = request
        self._stream = stream
        self._rec = recorder
        self._transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._status = 0
        self._length: int | None = None  # Content-Length; None before the head or if chunked
        self._chunked = False
        self._body = b""  # chunked: the decoded body so far
        self._head_done = False
        self._first_s: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self.closed.done():
            self.closed.set_result(None)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _send(self) -> None:
        assert self._transport is not None
        self._reset()
        self._sent_s = time.perf_counter()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._head_done:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self._buf[:end].split(b"\r\n")
            self._status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self._length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    self._chunked = True
            self._buf = self._buf[end + 4 :]
            self._head_done = True
        if self._chunked:
            self._read_chunks()
        elif self._length is not None and len(self._buf) >= self._length:
            self._finish(self._buf[: self._length])

    def _read_chunks(self) -> None:
        while True:
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                return
            size = int(self._buf[:line_end].split(b";")[0], 16)
            if size == 0:  # then the empty line (no trailers are sent)
                if len(self._buf) >= line_end + 4:
                    self._finish(self._body)
                return
            if len(self._buf) < line_end + 2 + size + 2:
                return
            self._body += self._buf[line_end + 2 : line_end + 2 + size]
            self._buf = self._buf[line_end + 2 + size + 2 :]
            if self._first_s is None and b"\n\n" in self._body:
                self._first_s = time.perf_counter()

    def _finish(self, body: bytes) -> None:
        done_s = time.perf_counter()
        rec = self._rec
        if rec.counting:
            ok = self._status == 200 and (not self._stream or body.endswith(DONE))
            if ok:
                rec.latency_s.append(done_s - self._sent_s)
                if self._first_s is not None:
                    rec.first_event_s.append(self._first_s - self._sent_s)
            else:
                rec.bad += 1
        if rec.running and self._transport is not None:
            self._send()
        elif self._transport is not None:
            self._transport.close()


async def measure(command: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    port, stream = int(command["port"]), bool(command["stream"])
    request = request_bytes(port, str(command["path"]), stream, command.get("authorization"))
    rec = Recorder()
    protocols: list[LoadProtocol] = []
    for _ in range(int(command["connections"])):
        _, proto = await loop.create_connection(
            lambda: LoadProtocol(request, stream, rec), "127.0.0.1", port
        )
        protocols.append(proto)
    await asyncio.sleep(float(command["warmup_s"]))
    rec.counting = True
    started_s = time.perf_counter()
    await asyncio.sleep(float(command["window_s"]))
    rec.counting = False
    elapsed_s = time.perf_counter() - started_s
    rec.running = False
    await asyncio.wait([p.closed for p in protocols], timeout=5)
    for proto in protocols:
        proto.abort()
    ms = [v * 1000 for v in rec.latency_s]
    first_ms = [v * 1000 for v in rec.first_event_s]
    return {
        "requests_per_s": len(ms) / elapsed_s,
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
        "first_event_p50_ms": percentile(first_ms, 0.5),
        "first_event_p99_ms": percentile(first_ms, 0.99),
        "completed": len(ms),
        "bad": rec.bad,
    }


async def serve_commands() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        try:
            result = await measure(json.loads(line))
        except (OSError, ValueError) as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)


def main() -> None:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve_commands())


if __name__ == "__main__":
    main()
