"""Discovery: DNS membership (fixed, resolved, kept on a transient failure, emptied when the
name has no address), probes against stub workers, and a router whose prefills come from DNS."""

from __future__ import annotations

import json
import socket

import aiohttp
from router_support import StubWorker, run_async, wait_until

from dsv4_common.api.names import WorkerRole
from dsv4_common.api.rank_config import Instance
from dsv4_router.choice import InstanceTable, assess
from dsv4_router.config import RoleTargets, RouterSettings
from dsv4_router.discovery import Discovery, resolve_host
from dsv4_router.liveness import LivenessRule
from dsv4_router.serve import start_router

FIXED = Instance("10.0.0.9", 9001, 9002, 9003)
RULE = LivenessRule(misses=3, grace_s=30.0)


def discovery(
    table: InstanceTable,
    session: aiohttp.ClientSession,
    roles: dict[WorkerRole, RoleTargets],
    answers: dict[str, tuple[str, ...] | None],
) -> Discovery:
    async def resolve(host: str, port: int) -> tuple[str, ...] | None:
        assert port == 8080
        return answers[host]

    return Discovery(
        table,
        roles,
        session,
        poll_interval_s=0.05,
        status_timeout_s=5.0,
        liveness=RULE,
        resolve=resolve,
    )


@run_async
async def test_dns_membership() -> None:
    answers: dict[str, tuple[str, ...] | None] = {"prefill.svc": ("10.0.0.2", "10.0.0.1")}
    roles: dict[WorkerRole, RoleTargets] = {
        "prefill": RoleTargets(
            service="prefill.svc", http_port=8080, status_port=8081, kv_port=8083
        ),
        "decode": RoleTargets(instances=(FIXED,), service="ignored.svc"),
    }
    table = InstanceTable()
    async with aiohttp.ClientSession() as session:
        found = discovery(table, session, roles, answers)
        await found.refresh()
        assert [(r.role, r.instance) for r in table.records()] == [
            ("decode", FIXED),
            ("prefill", Instance("10.0.0.1", 8080, 8081, 8083)),
            ("prefill", Instance("10.0.0.2", 8080, 8081, 8083)),
        ]
        answers["prefill.svc"] = None  # a transient DNS failure keeps what is known
        await found.refresh()
        assert len(table.records()) == 3
        answers["prefill.svc"] = ()  # no ready pod behind the headless Service
        await found.refresh()
        assert [r.role for r in table.records()] == ["decode"]


@run_async
async def test_resolve_host_numeric() -> None:
    assert await resolve_host("127.0.0.1", 80) == ("127.0.0.1",)


@run_async
async def test_probes_fill_the_records() -> None:
    good, garbled = StubWorker("decode"), StubWorker("prefill", status_valid=False)
    for worker in (good, garbled):
        await worker.start()
    gone = Instance("127.0.0.1", good.http_port, garbled.http_port, 1)  # no /status there
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = Instance("127.0.0.1", 1, sock.getsockname()[1], 1)
    roles: dict[WorkerRole, RoleTargets] = {
        "decode": RoleTargets(instances=(good.instance,)),
        "prefill": RoleTargets(instances=(garbled.instance, gone, closed)),
    }
    table = InstanceTable()
    try:
        async with aiohttp.ClientSession() as session:
            await discovery(table, session, roles, {}).round()
    finally:
        for worker in (good, garbled):
            await worker.stop()
    views = {r.instance: r for r in table.records()}
    decode = views[good.instance]
    assert decode.ready and decode.status is not None
    assert decode.status.load == good.load
    assert assess(decode, decode.status_at_s or 0.0, RULE)[0] == "eligible"
    assert views[garbled.instance].status is None
    assert "status.load.free_full_tokens" in (views[garbled.instance].error or "")
    assert views[gone].status is None and views[gone].error is not None
    # An answer that is not a status is a miss; a refused connection says nothing listens.
    assert not views[gone].liveness.refused and views[gone].liveness.misses == 1
    assert views[closed].liveness.refused


@run_async
async def test_a_router_with_dns_prefills() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    for worker in (prefill, decode):
        await worker.start()
    roles: dict[WorkerRole, RoleTargets] = {
        "prefill": RoleTargets(
            service="prefill.svc",
            http_port=prefill.http_port,
            status_port=prefill.status_port,
            kv_port=prefill.kv_port,
        ),
        "decode": RoleTargets(instances=(decode.instance,)),
    }
    settings = RouterSettings(
        host="127.0.0.1", port=0, status_port=0, roles=roles, poll_interval_s=0.05
    )

    async def resolve(host: str, port: int) -> tuple[str, ...] | None:
        return ("127.0.0.1",) if host == "prefill.svc" else ()

    try:
        async with (
            start_router(settings, resolve=resolve) as listening,
            aiohttp.ClientSession() as client,
        ):
            assert listening.status_port not in (None, listening.api_port)
            api = f"http://127.0.0.1:{listening.api_port}"
            probes = f"http://127.0.0.1:{listening.status_port}"

            async def ready() -> bool:
                async with client.get(probes + "/ready") as resp:
                    return resp.status == 200

            await wait_until(ready, "/ready on the status port")
            for path in ("/live", "/metrics"):
                async with client.get(probes + path) as resp:
                    assert resp.status == 200, path
            async with client.post(api + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 200
                assert json.loads(await resp.read())["id"] == "cmpl-j"
            assert [s.prefill for s in decode.seen] == [prefill.kv_address]
    finally:
        for worker in (prefill, decode):
            await worker.stop()
