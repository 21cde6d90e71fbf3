"""What the tests expect of the operator's status, written out once (never derived from the
code under test)."""

from __future__ import annotations

from typing import Final

# A deployment that serves: every role, the router and KV transfer up, nothing degraded.
SERVING_CONDITIONS: Final = {
    "Ready": "True",
    "Progressing": "False",
    "Degraded": "False",
    "PlanValid": "True",
    "ContextFits": "True",
    "WeightsReady": "True",
    "KVTransferReady": "True",
    "CapacityMatchesPlan": "True",
}
