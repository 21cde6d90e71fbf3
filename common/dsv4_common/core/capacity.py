"""What one worker rank can hold: the capacity quadruple, defined once. Pure.

The planner derives it (`RankPlan.capacity`), the rank config carries the planned one, a
worker reports the realized one on /status, and the router and the operator read it there:
every one of them holds this type. It lives in `core`, the lowest layer, because the planner
(`dsv4_common.plan`) builds it and the contract (`dsv4_common.api`, which re-exports it)
carries it; `api` may import `plan` and `core`, never the reverse.

On the wire it is the object `{"full_tokens", "swa_tokens", "max_running_requests",
"max_context_tokens"}` (the field names, through `dsv4_common.api.documents`).

NOTE: every count is a non-negative integer. Nothing more is an invariant: an auto-sized SWA
pool may be larger than the full pool (a short context with a long window), and a report
from another worker version is not re-checked against its own plan.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dsv4_common.core.invariants import FieldError


@dataclass(frozen=True, slots=True)
class RankCapacity:
    """Tokens and requests one rank's pools hold (a PP group serves the least over its ranks)."""

    full_tokens: int  # tokens of the full-attention pool (every token of every request)
    swa_tokens: int  # tokens of the sliding-window pool (the window of every request)
    max_running_requests: int  # request slots: requests decoded at once
    max_context_tokens: int  # the longest request (prompt + output) it takes

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise FieldError(f.name, f"must be an integer, got {value!r}")
            if value < 0:
                raise FieldError(f.name, f"must be >= 0, got {value}")
