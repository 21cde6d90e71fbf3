"""Where one stage sits in its PP group and where the group meets: plain data, no torch (the
options of `dsv4 serve` hold it before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PPSpec:
    """This process's place in its PP group and where the group meets (rank 0's PP port)."""

    rank: int
    size: int
    host: str
    port: int
    start_timeout_s: float = 300.0
    timeout_s: float = 30.0
    listen_host: str | None = None  # rank 0 listens here (the worker's --host); None: `host`
