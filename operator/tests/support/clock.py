"""A clock the tests drive: the operator's restart backoff reads it (`reconcile(clock=...)`,
`handlers.utc_clock`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class Clock:
    def __init__(self, start: datetime | None = None) -> None:
        self.now = start if start is not None else datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
