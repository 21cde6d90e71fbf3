"""Listening for the apps of `http_guard`: the port is taken before a process does its slow
start-up (`bind`, from `listen_sockets`: a busy port or a bad host fails at once, naming the
flag), and the listener admits at most the guard's `max_connections` (`serve_on`): past it
the oldest connection without a whole request is closed to make room (a slow or half-sent
client cannot starve /health or a completion), and a new one gets a fast 503 only when every
open one is busy.
`serve_on(..., fast=factory)`: new connections start on the factory's protocol (the router's
`fast_path`), counted by the bound as `Guard.fast`, and closed when the listener stops.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterable
from typing import Final, cast

from aiohttp import web
from aiohttp.web_runner import BaseRunner

from dsv4_common.api.http_rules import OpenConnection, admit, error_document
from dsv4_router.http_guard import ACCEPT_BATCH, GUARD, Guard, Held, new_protocol
from dsv4_router.listen_sockets import LISTEN_BACKLOG as LISTEN_BACKLOG
from dsv4_router.listen_sockets import ListenError as ListenError
from dsv4_router.listen_sockets import bind as bind
from dsv4_router.listen_sockets import raise_fd_limit as raise_fd_limit

# Past a drain a server stops accepting, then answers what arrives on the connections it had
# accepted for this long before it closes them (`stop_accepting`).
ACCEPTED_LINGER_S: Final = 0.5
REFUSED: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
REFUSED_BODY: Final = json.dumps(
    error_document(
        "too many open connections; retry later", "server_error", code="too_many_connections"
    )
).encode()


class _Refused(asyncio.Protocol):
    """A connection past the limit while every open one is busy: a 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        transport.write(REFUSED % (len(REFUSED_BODY), REFUSED_BODY))
        transport.close()


# A protocol for a new connection that is not aiohttp's own (it may hand itself over).
FastFactory = Callable[[], asyncio.Protocol]


class GuardedSite(web.BaseSite):
    """A pre-bound listening socket whose new connections go through `admit`."""

    __slots__ = ("_fast", "_guard", "_sock")

    def __init__(
        self,
        runner: BaseRunner,
        sock: socket.socket,
        guard: Guard,
        fast: FastFactory | None = None,
    ) -> None:
        super().__init__(runner)
        self._sock = sock
        self._guard = guard
        self._fast = fast

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        # asyncio takes `backlog` as both the kernel's queue and its accept batch: serve with
        # the small batch, then give the kernel a deep queue again (a burst of connections
        # must not overflow it: a dropped SYN costs a client a 1 s retransmit).
        self._server = await loop.create_server(
            self._connection, sock=self._sock, backlog=ACCEPT_BATCH
        )
        self._sock.listen(LISTEN_BACKLOG)

    def stop_accepting(self) -> None:
        """Close the listening socket; the connections it accepted stay open (`stop` closes
        them)."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        await super().stop()
        for conn in list(self._guard.fast):  # aiohttp's own close with the runner
            conn.close()

    def _connection(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        guard = self._guard
        # asyncio accepts a batch of connections and asks for all their handlers in one loop
        # pass; each is connected (known to the server) in the next. Handed out but not yet
        # connected, they count too (and cannot be closed): `guard.fresh` holds them one pass.
        known, now_s = set(server.connections), time.monotonic()
        if not guard.fresh:
            asyncio.get_running_loop().call_soon(guard.fresh.clear)
        held_now = cast("set[object]", guard.fast)  # connected: counted below
        connecting = [h for h in guard.fresh if h not in known and h not in held_now]
        live = [h for h in known if h.transport is not None]
        guard.opened_s = {h: guard.opened_s.get(h, now_s) for h in (*live, *connecting)}
        views = [OpenConnection(guard.opened_s[h], guard.busy(h)) for h in live]
        views += [OpenConnection(guard.opened_s[h], busy=True) for h in connecting]
        held: list[Held] = list(guard.fast)
        views += [OpenConnection(c.opened_s, c.busy) for c in held]
        decision = admit(views, guard.max_connections)
        if not decision.accept:
            guard.note(refused=1)
            return _Refused()
        for i in decision.evict:
            if i >= len(live):  # never one connecting: those count as busy
                held[i - len(live) - len(connecting)].close()
                continue
            if live[i] in guard.handling:
                guard.evicted_handlers.add(live[i])
            live[i].force_close()
        if decision.evict:
            guard.note(evicted=len(decision.evict))
        handler = self._fast() if self._fast is not None else new_protocol(server)
        guard.opened_s[handler] = now_s
        guard.fresh.append(handler)
        return handler


async def stop_accepting(
    runners: Iterable[BaseRunner], linger_s: float = ACCEPTED_LINGER_S
) -> None:
    """Close every listening socket of `runners` (a new connection is refused), then keep
    serving the connections they had accepted for `linger_s` before the runners' cleanup
    closes them: a request sent just before the listeners closed gets its answer (a 503
    `draining` past a drain), never a connection closed without a response."""
    for runner in runners:
        for site in runner.sites:
            if isinstance(site, GuardedSite):
                site.stop_accepting()
    await asyncio.sleep(linger_s)


async def serve_on(
    runner: web.AppRunner, sockets: list[socket.socket], fast: FastFactory | None = None
) -> int:
    """Serve the runner's app on pre-bound sockets (`runner.setup()` first); the bound port.
    `fast`: new connections start on its protocols (see the module's docstring)."""
    guard = runner.app[GUARD]
    for sock in sockets:
        await GuardedSite(runner, sock, guard, fast).start()
    port: int = sockets[0].getsockname()[1]
    return port
