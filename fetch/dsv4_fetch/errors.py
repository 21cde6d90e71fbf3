"""The one error of a fetch: a CamelCase reason (`dsv4_common.api.fetch_status.FAILURE_REASONS`)
and a message naming the source, file or tensor. Pure."""

from __future__ import annotations

from dsv4_common.api.fetch_status import FAILURE_REASONS


class FetchError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        assert reason in FAILURE_REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        """Trying again may help (network, the hub's 5xx); else only a change can."""
        return FAILURE_REASONS[self.reason]

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"
