"""Per-pool usage counters (used/total units) that the server exports as Prometheus gauges."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolUsage:
    pool: str  # "full", "swa" or "req_slots"
    used: int  # units in use (the reserved unit 0 excluded)
    total: int  # usable units (the reserved unit 0 excluded)

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0
