"""`dsv4 serve --role router`: settings from the arguments, then discovery and the HTTP apps
until SIGTERM or SIGINT (exit 0). A bad argument or config, or a port it cannot listen on,
prints `dsv4 serve: error: ...` naming it and exits 2.

`start_router` is the whole router as an async context manager (tests run it in-process).
`run` picks the event loop and settles the garbage collector once listening (`runtime`), and
with `--router-processes` N > 1 (default: by CPUs, `config.default_processes`) runs N such
routers on one port (`processes`: what each process shares and what it keeps to itself).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import aiohttp
from aiohttp import web

from dsv4_common.api.api_key import exposed_without_key
from dsv4_common.api.http_rules import HttpLimits
from dsv4_common.core.cpus import available_cpus
from dsv4_router.app import RouterState, build_api_app, build_probe_app, fast_completion
from dsv4_router.busy_poll import BusyPoll
from dsv4_router.choice import InstanceTable, choose_pair, host_port
from dsv4_router.config import ConfigError, RouterSettings, default_processes, settings_from_args
from dsv4_router.discovery import Discovery, Resolver, resolve_host
from dsv4_router.drain import drain
from dsv4_router.fast_path import FastFront
from dsv4_router.http_auth import require_api_key
from dsv4_router.http_guard import GUARD, make_runner, new_protocol
from dsv4_router.http_listen import (
    ACCEPTED_LINGER_S,
    ListenError,
    bind,
    raise_fd_limit,
    serve_on,
    stop_accepting,
)
from dsv4_router.metrics import RouterMetrics, SharedCounts
from dsv4_router.processes import STOP_SIGNAL, Prebound, run_processes
from dsv4_router.proxy import Proxy
from dsv4_router.reload import RolesFile
from dsv4_router.runtime import loop_factory, settle_gc
from dsv4_router.upstream import Upstream

# Status probes in flight at once (one /status and one /ready per instance per round).
MAX_PROBE_CONNECTIONS: Final = 256


@dataclass(frozen=True, slots=True)
class Listening:
    state: RouterState
    api_port: int
    status_port: int | None  # None: probes on the API port only
    runners: tuple[web.AppRunner, ...]

    async def stop_accepting(self, linger_s: float = ACCEPTED_LINGER_S) -> None:
        await stop_accepting(self.runners, linger_s)


@contextlib.asynccontextmanager
async def start_router(
    settings: RouterSettings,
    *,
    clock: Callable[[], float] = time.monotonic,
    resolve: Resolver = resolve_host,
    prebound: Prebound | None = None,
    counts: SharedCounts | None = None,
    process: int = 0,
) -> AsyncIterator[Listening]:
    """Discovery running and the apps listening; everything stops on exit. `prebound`: the
    sockets to serve on (else bound here); `counts`, `process`: the counters shared with the
    router's other processes and this one's row (`metrics.SharedCounts`)."""
    table = InstanceTable()
    for role, targets in settings.roles.items():
        table.sync(role, targets.instances)
    metrics = RouterMetrics(
        lambda: (table.records(), clock()), settings.liveness, counts=counts, process=process
    )
    # The router's own key goes to the workers (their /status and API want it).
    credential = settings.auth.credential()
    upstream_headers = {"Authorization": credential} if credential is not None else None
    probe_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=MAX_PROBE_CONNECTIONS), headers=upstream_headers
    )
    # No total timeout: a stream lasts as long as its generation.
    api_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
        headers=upstream_headers,
    )
    busy_poll = BusyPoll(settings.busy_poll_s)
    upstream = Upstream(
        connect_timeout_s=settings.connect_timeout_s,
        look_every_s=settings.stall.look_every_s,
        busy_poll=busy_poll,
    )
    proxy = Proxy(table, settings, metrics, api_session, upstream, clock)
    state = RouterState(settings, table, metrics, proxy, clock, process, busy_poll=busy_poll)
    discovery = Discovery(
        table,
        settings.roles,
        probe_session,
        poll_interval_s=settings.poll_interval_s,
        status_timeout_s=settings.status_timeout_s,
        liveness=settings.liveness,
        clock=clock,
        resolve=resolve,
        after_round=lambda: metrics.note_ready(
            choose_pair(table.records(), clock(), settings.liveness) is not None
        ),
        reload=RolesFile(Path(settings.config_path)).changed if settings.config_path else None,
    )
    polling = asyncio.create_task(discovery.run())
    runners: list[web.AppRunner] = []
    try:
        if prebound is None:
            prebound = bind_router(settings)
        api_app = build_api_app(state)
        # Without a status port of its own, the API port is the status port (`api_key`).
        require_api_key(api_app, settings.auth, status_port=prebound.status is None)
        api_port = await _listen(api_app, settings, prebound.api, runners, fast=state)
        status_port = None
        if prebound.status is not None:
            status_app = build_probe_app(state)
            require_api_key(status_app, settings.auth, status_port=True)
            status_port = await _listen(status_app, settings, prebound.status, runners)
        yield Listening(state, api_port, status_port, tuple(runners))
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        polling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await polling
        upstream.close()
        await api_session.close()
        await probe_session.close()


def _separate(status_port: int, api_port: int) -> bool:
    """A status port equal to the API port is served once; 0 (any free port) never is."""
    return status_port == 0 or status_port != api_port


def bind_router(settings: RouterSettings, *, reuse_port: bool = False) -> Prebound:
    """The API's listening sockets and, when it is a port of its own, the status port's;
    ConfigError names the flag or field of a port that cannot be listened on."""
    api: list[socket.socket] = []
    try:
        api = bind(settings.host, settings.port, settings.port_name, reuse_port=reuse_port)
        status = None
        if settings.status_port is not None and _separate(settings.status_port, settings.port):
            status_port = settings.status_port
            status = bind(
                settings.host, status_port, settings.status_port_name, reuse_port=reuse_port
            )
    except ListenError as exc:
        for sock in api:
            sock.close()
        raise ConfigError(str(exc)) from exc
    return Prebound(api, status)


def bind_copies(settings: RouterSettings, copies: int) -> list[Prebound]:
    """`copies` sets of sockets on the same ports (SO_REUSEPORT; a port 0 becomes the one the
    first set took)."""
    first = bind_router(settings, reuse_port=True)
    taken = replace(
        settings,
        port=first.api[0].getsockname()[1],
        status_port=None if first.status is None else first.status[0].getsockname()[1],
    )
    out = [first]
    try:
        for _ in range(copies - 1):
            out.append(bind_router(taken, reuse_port=True))
    except ConfigError:
        for done in out:
            done.close()
        raise
    return out


async def _listen(
    app: web.Application,
    settings: RouterSettings,
    sockets: list[socket.socket],
    runners: list[web.AppRunner],
    *,
    fast: RouterState | None = None,
) -> int:
    """Serve `app` on the bound `sockets` under the HTTP rules (`http_guard`); returns the
    bound port. Handlers are cancelled when their client disconnects (that is what closes
    the upstream request, streaming or not). `fast`: completions take `fast_path`."""
    runner = make_runner(app, shutdown_timeout_s=settings.shutdown_timeout_s)
    await runner.setup()
    runners.append(runner)
    if fast is None:
        return await serve_on(runner, sockets)
    server = runner.server
    assert server is not None
    front = FastFront(
        functools.partial(fast_completion, fast),
        app[GUARD],
        lambda: new_protocol(server),
        fast.busy_poll,
        auth=fast.settings.auth,
    )
    return await serve_on(runner, sockets, fast=front)


async def _serve(settings: RouterSettings, *, child: _Child | None = None) -> None:
    """Until SIGTERM or SIGINT; `child`: one of several processes (`run_processes` says
    where it listens), else this process is the router and prints where it listens."""
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    # One of several processes stops when the parent says so (`processes`: signals).
    signals = (signal.SIGTERM, signal.SIGINT) if child is None else (STOP_SIGNAL,)
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, stop, hurry)
    try:
        if child is None:
            started = start_router(settings)
        else:
            started = start_router(
                settings, prebound=child.prebound, counts=child.counts, process=child.index
            )
        async with started as listening:
            settle_gc()
            if child is None:
                _print_listening(settings, listening.api_port, listening.status_port)
            else:
                child.ready()
            await stop.wait()
            # Still listening: /ready answers 503 and new completions are refused meanwhile.
            listening.state.drain.start()
            timeout_s = settings.shutdown_timeout_s
            await drain(listening.state.drain, timeout_s=timeout_s, hurried=hurry)
            if not hurry.is_set():
                await listening.stop_accepting()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _on_signal(stop: asyncio.Event, hurry: asyncio.Event) -> None:
    """The first signal starts the drain, a second one ends it at once."""
    if stop.is_set():
        hurry.set()
    stop.set()


@dataclass(frozen=True, slots=True)
class _Child:
    prebound: Prebound
    counts: SharedCounts
    index: int
    ready: Callable[[], None]


def per_process_limits(limits: HttpLimits, count: int) -> HttpLimits:
    """One of `count` processes' share of a set connection bound (rounded up); a bound from
    the fd limit stays each process's own (each has its own descriptors)."""
    if limits.max_connections is None:
        return limits
    return replace(limits, max_connections=-(-limits.max_connections // count))


def _print_listening(settings: RouterSettings, api_port: int, status_port: int | None) -> None:
    url = f"http://{host_port(settings.host, api_port)}"
    print(f"dsv4 serve: router listening on {url}", flush=True)
    if status_port is not None:
        probes = f"http://{host_port(settings.host, status_port)}"
        print(f"dsv4 serve: router probes and metrics on {probes}", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if (warning := exposed_without_key(settings.host, settings.auth)) is not None:
        logging.getLogger(__name__).warning("%s", warning)  # once, whatever the processes
    raise_fd_limit()  # before the apps size their connection bound from it
    count = settings.processes or default_processes(available_cpus())
    settings = replace(settings, processes=count)
    name, factory = loop_factory()
    logging.getLogger(__name__).info("event loop: %s; %d router process(es)", name, count)
    try:
        if count > 1:
            return _run_processes(settings, count, factory)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve(settings))
    except ConfigError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_processes(
    settings: RouterSettings, count: int, factory: Callable[[], asyncio.AbstractEventLoop]
) -> int:
    """`count` routers on the same ports (bound here, so a busy port is exit 2 at once); a
    `--max-connections` bound is shared out among them."""
    settings = replace(settings, http=per_process_limits(settings.http, count))
    copies = bind_copies(settings, count)
    api_port = copies[0].api[0].getsockname()[1]
    status = copies[0].status
    status_port = None if status is None else status[0].getsockname()[1]

    def main(own: Prebound, counts: SharedCounts, index: int, ready: Callable[[], None]) -> int:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve(settings, child=_Child(own, counts, index, ready)))
        return 0

    def on_ready() -> None:
        _print_listening(settings, api_port, status_port)

    return run_processes(copies, main, on_ready)
