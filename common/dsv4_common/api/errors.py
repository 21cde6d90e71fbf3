"""The operator's spec error type (shared by the parser and its field reader)."""

from __future__ import annotations


class SpecError(ValueError):
    """The spec is invalid. `errors` holds one message per bad field, each naming its path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = tuple(errors)
        super().__init__("; ".join(errors))
