"""A bare relay for bench/router.py: what any asyncio relay costs on this machine, with
nothing of a router in it (no parsing, no choice, no checks).

    python bench/router_relay.py UPSTREAM_PORT [--busy-poll-us US]

Listens on a free port of 127.0.0.1 and prints it (one JSON line `{"port": P}`); each client
connection gets its own connection to UPSTREAM_PORT and the bytes go both ways as they come
(uvloop protocols when uvloop is installed). `--busy-poll-us US` keeps the loop polling US
after each write, with the router's own `dsv4_router.busy_poll.BusyPoll`: the same
lever in front of nothing else (bench/README.md, "The router hop").
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import cast

from router_stub import new_event_loop

from dsv4_router.busy_poll import BusyPoll


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self._client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._client.send(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()


class _Client(asyncio.Protocol):
    def __init__(self, upstream_port: int, poll: BusyPoll) -> None:
        self._port = upstream_port
        self._poll = poll
        self._transport: asyncio.Transport | None = None
        self._upstream: _Upstream | None = None
        self._early: list[bytes] = []  # bytes before the upstream connection is up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(lambda: _Upstream(self), "127.0.0.1", self._port)
        self._upstream = upstream
        for data in self._early:
            self._forward(data)
        self._early.clear()

    def data_received(self, data: bytes) -> None:
        if self._upstream is None:
            self._early.append(data)
        else:
            self._forward(data)

    def _forward(self, data: bytes) -> None:
        assert self._upstream is not None and self._upstream.transport is not None
        self._upstream.transport.write(data)
        self._poll.kick()

    def send(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)
            self._poll.kick()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._upstream is not None and self._upstream.transport is not None:
            self._upstream.transport.close()


async def serve(upstream_port: int, busy_poll_us: int) -> None:
    loop = asyncio.get_running_loop()
    poll = BusyPoll(busy_poll_us / 1e6)
    server = await loop.create_server(lambda: _Client(upstream_port, poll), "127.0.0.1", 0)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--busy-poll-us", type=int, default=0, metavar="US")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve(args.upstream_port, args.busy_poll_us))


if __name__ == "__main__":
    main()
