"""A stub worker (`router_support.StubWorker`) in a process of its own, so that a test can
stop it with SIGSTOP: prints its instance as one JSON line, then serves until SIGTERM.

    python stub_process.py ROLE [MODE [GAP_S EVENTS]]   # a StubWorker mode (default json);
                                                        # `trickle`: its gap and events
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from router_support import StubWorker

from dsv4_common.api.names import WORKER_ROLES


async def main(name: str, mode: str = "json", gap_s: str = "0.05", events: str = "20") -> None:
    (role,) = [r for r in WORKER_ROLES if r == name]
    worker = StubWorker(role, mode=mode)  # type: ignore[arg-type]
    worker.gap_s, worker.trickle_events = float(gap_s), int(events)
    await worker.start()
    instance = worker.instance
    doc = {"host": instance.host, "http_port": instance.http_port}
    doc |= {"status_port": instance.status_port, "kv_port": instance.kv_port}
    print(json.dumps(doc), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await worker.stop()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
