"""Liveness under starvation (issue #25 item 3), with a real router in-process and a decode
stub in a process of its own: stopped (SIGSTOP) for less than the grace, it stays eligible and
a request sent meanwhile succeeds once it resumes (no spurious 503); stopped for longer, it
turns stale only after the grace and the missed probes, the router answers 503, and it is
eligible again once resumed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Final

import aiohttp
import pytest
from router_support import StubWorker, stub_process, wait_until

from dsv4_common.api.rank_config import Instance
from dsv4_router.config import RoleTargets, RouterSettings
from dsv4_router.serve import start_router

pytestmark = pytest.mark.slow
POLL_S: Final = 0.1
PROBE_TIMEOUT_S: Final = 0.5
MISSES: Final = 3
GRACE_S: Final = 5.0  # >> a short stop + a poll + a round (1.6 s): room for a loaded machine
SHORT_STOP_S: Final = 1.0
TEST_TIMEOUT_S: Final = 120.0
BODY: Final = {"prompt": "hi", "max_tokens": 2}


def test_a_stop_shorter_than_the_grace_refuses_nothing_a_longer_one_is_stale() -> None:
    async def scenario() -> None:
        prefill = StubWorker("prefill")
        await prefill.start()
        try:
            with stub_process("decode") as (proc, decode):
                await _scenario(prefill, proc.pid, decode)
        finally:
            await prefill.stop()

    async def bounded() -> None:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await scenario()

    asyncio.run(bounded())


async def _scenario(prefill: StubWorker, pid: int, decode: Instance) -> None:
    settings = RouterSettings(
        host="127.0.0.1",
        port=0,
        status_port=0,
        roles={
            "prefill": RoleTargets(instances=(prefill.instance,)),
            "decode": RoleTargets(instances=(decode,)),
        },
        poll_interval_s=POLL_S,
        status_timeout_s=PROBE_TIMEOUT_S,
        stale_after_misses=MISSES,
        stale_after_s=GRACE_S,
        stale_after_polls=1.0,
        shutdown_timeout_s=1.0,
    )
    async with start_router(settings) as listening, aiohttp.ClientSession() as client:
        api = f"http://127.0.0.1:{listening.api_port}"
        status_url = f"http://127.0.0.1:{listening.status_port}/status"

        async def decode_view() -> dict[str, Any]:
            async with client.get(status_url) as resp:
                assert resp.status == 200
                doc = await resp.json()
            (view,) = [v for v in doc["instances"] if v["role"] == "decode"]
            return dict(view)

        async def post() -> tuple[int, dict[str, str]]:
            async with client.post(f"{api}/v1/completions", json=BODY) as resp:
                await resp.read()
                return resp.status, dict(resp.headers)

        async def router_ready() -> bool:
            async with client.get(f"{api}/ready") as resp:
                return resp.status == 200

        await wait_until(router_ready, "both stubs eligible")

        # 1. Stopped for less than the grace: every sample eligible, a request waits it out.
        os.kill(pid, signal.SIGSTOP)
        stopped_s = time.monotonic()
        request = asyncio.create_task(post())
        states: list[str] = []
        try:
            while time.monotonic() - stopped_s < SHORT_STOP_S:
                states.append((await decode_view())["state"])
                await asyncio.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_s = time.monotonic()
        while time.monotonic() - resumed_s < 2.0:  # the probes in flight and the next rounds
            states.append((await decode_view())["state"])
            await asyncio.sleep(0.05)
        assert set(states) == {"eligible"}, states
        status, _ = await request
        assert status == 200

        # 2. Stopped for good: stale only once the grace passed and the probes missed.
        os.kill(pid, signal.SIGSTOP)
        try:
            stale: dict[str, Any] = {}

            async def is_stale() -> bool:
                stale.update(await decode_view())
                return stale["state"] == "stale"

            await wait_until(is_stale, "the stopped decode to turn stale", 60.0)
            assert stale["status_age_s"] >= GRACE_S
            assert stale["missed_probes"] >= MISSES
            assert "probes in a row failed" in stale["reason"]
            status, headers = await post()
            assert status == 503 and headers["Retry-After"] == "1"
        finally:
            os.kill(pid, signal.SIGCONT)

        # 3. Resumed: eligible again, requests succeed.
        await wait_until(router_ready, "the resumed decode to be eligible again", 60.0)
        assert (await post())[0] == 200
