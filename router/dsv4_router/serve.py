"""`dsv4 serve --role router`: settings from the arguments, then discovery and the HTTP apps
until SIGTERM or SIGINT (exit 0). A bad argument or config, or a port it cannot listen on,
prints `dsv4 serve: error: ...` naming it and exits 2.

`start_router` is the whole router as an async context manager (tests run it in-process).
`run` picks the event loop and settles the garbage collector once listening (`runtime`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from dsv4_router.app import RouterState, build_api_app, build_probe_app
from dsv4_router.choice import InstanceTable, host_port
from dsv4_router.config import ConfigError, RouterSettings, settings_from_args
from dsv4_router.discovery import Discovery, Resolver, resolve_host
from dsv4_router.http_guard import make_runner
from dsv4_router.http_listen import ListenError, bind, raise_fd_limit, serve_on
from dsv4_router.metrics import RouterMetrics
from dsv4_router.proxy import Proxy
from dsv4_router.runtime import loop_factory, settle_gc
from dsv4_router.upstream import Upstream

# Status probes in flight at once (one /status and one /ready per instance per round).
MAX_PROBE_CONNECTIONS: Final = 256


@dataclass(frozen=True, slots=True)
class Listening:
    state: RouterState
    api_port: int
    status_port: int | None  # None: probes on the API port only


@contextlib.asynccontextmanager
async def start_router(
    settings: RouterSettings,
    *,
    clock: Callable[[], float] = time.monotonic,
    resolve: Resolver = resolve_host,
) -> AsyncIterator[Listening]:
    """Discovery running and the apps listening; everything stops on exit."""
    table = InstanceTable()
    for role, targets in settings.roles.items():
        table.sync(role, targets.instances)
    metrics = RouterMetrics(lambda: (table.records(), clock()), settings.liveness)
    probe_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=MAX_PROBE_CONNECTIONS)
    )
    # No total timeout: a stream lasts as long as its generation.
    api_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
    )
    upstream = Upstream(connect_timeout_s=settings.connect_timeout_s)
    proxy = Proxy(table, settings, metrics, api_session, upstream, clock)
    state = RouterState(settings, table, metrics, proxy, clock)
    discovery = Discovery(
        table,
        settings.roles,
        probe_session,
        poll_interval_s=settings.poll_interval_s,
        status_timeout_s=settings.status_timeout_s,
        liveness=settings.liveness,
        clock=clock,
        resolve=resolve,
    )
    polling = asyncio.create_task(discovery.run())
    runners: list[web.AppRunner] = []
    try:
        api_port = await _listen(
            build_api_app(state), settings, settings.port, settings.port_name, runners
        )
        status_port = None
        if settings.status_port is not None and _separate(settings.status_port, settings.port):
            status_port = await _listen(
                build_probe_app(state),
                settings,
                settings.status_port,
                settings.status_port_name,
                runners,
            )
        yield Listening(state, api_port, status_port)
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


async def _listen(
    app: web.Application,
    settings: RouterSettings,
    port: int,
    port_name: str,
    runners: list[web.AppRunner],
) -> int:
    """Serve `app` on (settings.host, port) under the HTTP rules (`http_guard`); returns the
    bound port. Handlers are cancelled when their client disconnects (that is what closes
    the upstream request, streaming or not)."""
    try:
        sockets = bind(settings.host, port, port_name)
    except ListenError as exc:
        raise ConfigError(str(exc)) from exc
    runner = make_runner(app, shutdown_timeout_s=settings.shutdown_timeout_s)
    await runner.setup()
    runners.append(runner)
    return await serve_on(runner, sockets)


async def _serve(settings: RouterSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        async with start_router(settings) as listening:
            settle_gc()
            url = f"http://{host_port(settings.host, listening.api_port)}"
            print(f"dsv4 serve: router listening on {url}", flush=True)
            if listening.status_port is not None:
                probes = f"http://{host_port(settings.host, listening.status_port)}"
                print(f"dsv4 serve: router probes and metrics on {probes}", flush=True)
            await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise_fd_limit()  # before the apps size their connection bound from it
    name, factory = loop_factory()
    logging.getLogger(__name__).info("event loop: %s", name)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve(settings))
    except ConfigError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
