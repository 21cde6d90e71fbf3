"""`dsv4 up`'s stop grace exceeds every server's drain (issue #25 items 4 and 5): a SIGKILL
before a server has ended its streams would cut them with no error event."""

from __future__ import annotations

import inspect

from dsv4_common.api.lifecycle import (
    ABORT_GRACE_S,
    DRAIN_S,
    ROUTER_DRAIN_S,
    STOP_GRACE_S,
    WORKER_STOP_S,
)
from dsv4_local.supervisor import Supervisor
from dsv4_local.up import launch
from dsv4_router.config import RouterSettings
from dsv4_worker import serve


def test_the_stop_grace_exceeds_every_drain() -> None:
    router = RouterSettings(host="127.0.0.1", port=0, status_port=None, roles={})
    worker_drain_s = inspect.signature(serve._serve).parameters["drain_timeout_s"].default
    # A worker: its drain, the aborted requests' last events, then closing its connections.
    assert worker_drain_s + 2 * ABORT_GRACE_S <= WORKER_STOP_S
    # The router outlasts the workers' drain, so their error events reach the clients.
    assert WORKER_STOP_S <= router.shutdown_timeout_s == ROUTER_DRAIN_S < STOP_GRACE_S
    assert worker_drain_s == DRAIN_S
    for stopper in (Supervisor, launch):
        assert inspect.signature(stopper).parameters["stop_grace_s"].default == STOP_GRACE_S
