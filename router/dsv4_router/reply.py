"""One completion as `proxy` sees it, whichever path the client's connection took: what came
(`Incoming`) and where the answer goes (`Reply`). aiohttp's app answers through `WebReply`;
the fast path (`fast_path`) through its own connection.

A Reply gets exactly one of: `answer` (a whole answer: status, headers, body), or `start`
then any number of `write` and at most one `end` (a streamed answer). Headers are the
end-to-end ones; each Reply adds the framing (Content-Length or chunked), Date and Server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web

Headers = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Incoming:
    method: str
    target: str  # the path and query as the client sent them
    path: str  # for log lines
    headers: Sequence[tuple[bytes, bytes]]  # raw (name, value) pairs, in order
    body: bytes

    def header(self, lower_name: bytes) -> str | None:
        """The first value of a header (`lower_name` lower-cased), or None."""
        for name, value in self.headers:
            if name.lower() == lower_name:
                return value.decode("latin-1")
        return None


class Reply(Protocol):
    @property
    def started(self) -> bool:
        """Bytes of the answer may have reached the client (no other answer can follow)."""
        ...

    def answer(self, status: int, headers: Headers, body: bytes) -> None: ...

    async def start(self, status: int, headers: Headers) -> None: ...

    async def write(self, data: bytes) -> bool:
        """False: the client has gone away."""
        ...

    async def end(self) -> None:
        """The streamed answer's end (ConnectionError if the client has gone)."""
        ...


class WebReply:
    """A Reply through aiohttp: `response` is what the handler returns."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self._request.writer.output_size > 0

    def answer(self, status: int, headers: Headers, body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start(self, status: int, headers: Headers) -> None:
        response = web.StreamResponse(status=status, headers=headers)
        self.response = response
        await response.prepare(self._request)

    async def write(self, data: bytes) -> bool:
        assert self.response is not None, "start() first"
        try:
            await self.response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            return False
        return True

    async def end(self) -> None:
        assert self.response is not None, "start() first"
        await self.response.write_eof()


async def end_quietly(reply: Reply) -> None:
    """End a streamed answer if the client is still there."""
    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
        await reply.end()
