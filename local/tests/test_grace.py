"""`dsv4 up`'s stop grace exceeds the servers' drain (issue #25 item 5): a SIGKILL before the
router's `shutdown_timeout_s` would cut its open streams with no error event."""

from __future__ import annotations

import inspect

from dsv4_common.api.lifecycle import DRAIN_S, STOP_GRACE_S
from dsv4_local.supervisor import Supervisor
from dsv4_local.up import launch
from dsv4_router.config import RouterSettings
from dsv4_router.http_guard import make_runner


def test_the_stop_grace_exceeds_every_drain() -> None:
    router = RouterSettings(host="127.0.0.1", port=0, status_port=None, roles={})
    worker_drain_s = inspect.signature(make_runner).parameters["shutdown_timeout_s"].default
    assert max(router.shutdown_timeout_s, worker_drain_s) <= DRAIN_S < STOP_GRACE_S
    for stopper in (Supervisor, launch):
        assert inspect.signature(stopper).parameters["stop_grace_s"].default == STOP_GRACE_S
