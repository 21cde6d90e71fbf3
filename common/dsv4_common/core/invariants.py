"""The error a frozen value raises when one of its own fields breaks an invariant. Pure.

It names the field, so the document decoder (`dsv4_common.api.documents`) reports the failing
field's full path (`status.capacity.full_tokens: must be >= 0, got -1`) rather than the path
of the value that holds it.
"""

from __future__ import annotations


class FieldError(ValueError):
    """`field` (a field of the value being built) breaks an invariant, stated by `reason`."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")
