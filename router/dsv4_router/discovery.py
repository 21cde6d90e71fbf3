"""Keeps the instance table current: every round it resolves each role's instances (fixed, or
every address of the role's DNS name) and probes every instance's `/status` and `/ready`,
all concurrently, then sleeps out the rest of `poll_interval_s`.

I/O only: what a probe means for a record is `choice.apply_probe`, and when missed probes
make an instance stale is `liveness`'s rule. A refused connection is told apart from the other
failures (nothing listens there: the process is gone).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import aiohttp

from dsv4_common.api.names import WorkerRole
from dsv4_common.api.rank_config import Instance
from dsv4_common.api.worker_status import WorkerStatus, parse_worker_status
from dsv4_router.choice import (
    Health,
    InstanceRecord,
    InstanceTable,
    Probe,
    apply_probe,
    assess,
    host_port,
)
from dsv4_router.config import RoleTargets
from dsv4_router.liveness import LivenessRule

log = logging.getLogger(__name__)

# getaddrinfo errors meaning "this name has no address" (not "ask again later").
_NO_ADDRESS: Final = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)

Resolver = Callable[[str, int], Awaitable[tuple[str, ...] | None]]


async def resolve_host(host: str, port: int) -> tuple[str, ...] | None:
    """Every address `host` resolves to, sorted; () when the name has none (a headless Service
    with no ready pod); None on a transient failure (keep the instances known so far). A
    dual-stack pod has an IPv4 and an IPv6 address: with any IPv4 address, only those count."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESS:
            return ()
        log.warning("resolving %s failed: %s", host, exc)
        return None
    ipv4 = {str(info[4][0]) for info in infos if info[0] == socket.AF_INET}
    return tuple(sorted(ipv4 or {str(info[4][0]) for info in infos}))


class Discovery:
    def __init__(
        self,
        table: InstanceTable,
        roles: Mapping[WorkerRole, RoleTargets],
        session: aiohttp.ClientSession,
        *,
        poll_interval_s: float,
        status_timeout_s: float,
        liveness: LivenessRule,
        clock: Callable[[], float] = time.monotonic,
        resolve: Resolver = resolve_host,
        after_round: Callable[[], None] = lambda: None,
        reload: Callable[[], Mapping[WorkerRole, RoleTargets] | None] | None = None,
    ) -> None:
        """`after_round`: called after every round (on the event loop); `reload`: the roles
        when they changed (router.json rewritten), else None."""
        self._reload = reload
        self._table = table
        self._after_round = after_round
        self._roles = roles
        self._session = session
        self._poll_interval_s = poll_interval_s
        self._status_timeout_s = status_timeout_s
        self._liveness = liveness
        self._clock = clock
        self._resolve = resolve
        self._health: dict[tuple[WorkerRole, Instance], Health] = {}

    async def run(self) -> None:
        """Rounds until cancelled; a failing round is logged, never fatal."""
        while True:
            started_s = self._clock()
            try:
                await self.round()
            except Exception:
                log.exception("discovery round failed")
            elapsed_s = self._clock() - started_s
            await asyncio.sleep(max(0.0, self._poll_interval_s - elapsed_s))

    async def round(self) -> None:
        await self.refresh()
        records = self._table.records()
        await asyncio.gather(*(self._poll(r) for r in records))
        self._log_changes(records)
        self._after_round()

    async def refresh(self) -> None:
        if self._reload is not None and (roles := self._reload()) is not None:
            self._roles = roles
        for role, targets in self._roles.items():
            if targets.instances or targets.service is None:
                self._table.sync(role, targets.instances)
                continue
            hosts = await self._resolve(targets.service, targets.http_port)
            if hosts is not None:
                self._table.sync(role, [targets.from_address(h) for h in hosts])

    async def _poll(self, record: InstanceRecord) -> None:
        sent_total = record.sent_total
        base = f"http://{host_port(record.instance.host, record.instance.status_port)}"
        (status, error, refused), ready = await asyncio.gather(
            self._fetch_status(f"{base}/status"), self._fetch_ready(f"{base}/ready")
        )
        apply_probe(record, Probe(status, ready, error, sent_total, refused), self._clock())

    async def _fetch_status(self, url: str) -> tuple[WorkerStatus | None, str | None, bool]:
        """(status, None, False), or (None, why, refused), or (None, None, False) on a
        timeout."""
        try:
            async with asyncio.timeout(self._status_timeout_s), self._session.get(url) as resp:
                if resp.status != 200:
                    return None, f"/status answered {resp.status}", False
                body = await resp.read()
        except TimeoutError:
            return None, None, False
        except (aiohttp.ClientError, OSError) as exc:
            return None, f"/status: {exc or type(exc).__name__}", _refused(exc)
        try:
            return parse_worker_status(json.loads(body)), None, False
        except ValueError as exc:  # JSONDecodeError and DocumentError are ValueErrors
            return None, f"/status: {exc}", False

    async def _fetch_ready(self, url: str) -> bool | None:
        """Whether /ready answered 200; None on a timeout."""
        try:
            async with asyncio.timeout(self._status_timeout_s), self._session.get(url) as resp:
                return resp.status == 200
        except TimeoutError:
            return None
        except (aiohttp.ClientError, OSError):
            return False

    def _log_changes(self, records: list[InstanceRecord]) -> None:
        now_s = self._clock()
        seen: dict[tuple[WorkerRole, Instance], Health] = {}
        for record in records:
            key = (record.role, record.instance)
            health, why = assess(record, now_s, self._liveness)
            seen[key] = health
            before = self._health.get(key)
            if before != health:
                where = host_port(record.instance.host, record.instance.http_port)
                suffix = f" ({why})" if why else ""
                log.info("%s %s: %s -> %s%s", record.role, where, before or "new", health, suffix)
        self._health = seen


def _refused(exc: BaseException) -> bool:
    """Whether connecting found nothing listening (aiohttp wraps the OSError)."""
    cause = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    return isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED
