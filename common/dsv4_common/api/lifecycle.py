"""How long a server drains after SIGTERM and how long `dsv4 up` waits before SIGKILL: one
number each, so the grace always exceeds the drain. Pure constants.

The router gives open streams `DRAIN_S` after SIGTERM (its `shutdown_timeout_s`); a
supervisor that killed it sooner would cut them with no error event.
"""

from __future__ import annotations

from typing import Final

DRAIN_S: Final = 20.0  # the router's open streams get this long after SIGTERM
STOP_GRACE_S: Final = DRAIN_S + 10.0  # dsv4 up: SIGTERM, then this long, then SIGKILL
