"""The PP rendezvous listens on the configured host only (issue #25 item 6): torch's own store
server binds every interface (`*:PORT`); rank 0 of a PipeLink hands it a socket bound to its
`listen_host`. Two link processes on loopback; the listeners are read from /proc/net/tcp*."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from link_support import rank_main
from listeners import listening_addresses
from serve_support import free_port

from dsv4_worker.pp.link import listen_socket

pytestmark = pytest.mark.slow
DEADLINE_S = 120.0  # two processes importing torch on a loaded 2-core machine


def test_rank_0_listens_on_the_configured_host_only() -> None:
    """Before: torch's store listened on `*:PORT` (0.0.0.0 or ::) although the group met on
    127.0.0.1."""
    address, port = "127.0.0.1", free_port()
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=rank_main, args=(r, address, port, address, DEADLINE_S, out, done), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=DEADLINE_S) for _ in procs)
        assert results == {0: [0, 1], 1: [0, 1]}, results
        assert listening_addresses(port) == {address}
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_listen_socket_binds_the_host_it_is_given() -> None:
    with listen_socket("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1"
        assert listening_addresses(port) == {"127.0.0.1"}
