"""GET /status on the router's status port (issue #25 item 5: the URL `dsv4 up` prints used to
answer 404): readiness and why not, every instance with its state, the settings."""

from __future__ import annotations

import json

from router_support import StubWorker, routed, run_async


@run_async
async def test_the_status_port_serves_the_routers_status() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode], status_port=0) as router:
        status_port = router.listening.status_port
        assert status_port is not None and status_port != router.listening.api_port
        url = f"http://127.0.0.1:{status_port}/status"
        async with router.client.get(url) as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            doc = json.loads(await resp.read())
        assert doc["ready"] is True and doc["reason"] is None
        assert doc["instance_counts"] == {
            "prefill": {"eligible": 1, "unready": 0, "stale": 0},
            "decode": {"eligible": 1, "unready": 0, "stale": 0},
        }
        views = {v["role"]: v for v in doc["instances"]}
        assert views["decode"]["http_port"] == decode.http_port
        assert views["decode"]["state"] == "eligible" and views["decode"]["missed_probes"] == 0
        settings = doc["settings"]
        assert settings["status_port"] == 0 and settings["poll_interval_s"] == 0.05
        assert settings["stale_after_misses"] == 3 and settings["stale_after_grace_s"] == 30.0
        assert settings["stall_after_s"] == 1.0
        assert settings["roles"]["decode"]["instances"][0]["http_port"] == decode.http_port

        decode.ready = False
        await router.wait_state("unready", decode)
        _, body = await router.get("/status")  # the API port serves it too
        doc = json.loads(body)
        assert doc["ready"] is False and "no ready decode" in doc["reason"]
        assert doc["instance_counts"]["decode"] == {"eligible": 0, "unready": 1, "stale": 0}
