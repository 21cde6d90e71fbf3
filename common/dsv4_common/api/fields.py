"""Typed access to one level of a parsed YAML/JSON object that records an error per bad field
(prefixed with its path) instead of raising, so a parser can report every error at once. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dsv4_common.api.errors import SpecError


class FieldReader:
    """Typed field access that records an error per bad field instead of raising."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def raise_if_any(self) -> None:
        if self.errors:
            raise SpecError(self.errors)

    def obj(self, raw: object, path: str, *, required: bool = False) -> Mapping[str, Any]:
        if raw is None:
            if required:
                self.fail(path, "required")
            return {}
        if not isinstance(raw, Mapping):
            self.fail(path, f"must be an object, got {type(raw).__name__}")
            return {}
        return raw

    def keys(self, m: Mapping[str, Any], path: str, allowed: set[str]) -> None:
        for key in sorted(set(m) - allowed):
            self.fail(f"{path}.{key}", f"unknown field (allowed: {', '.join(sorted(allowed))})")

    def integer(
        self,
        m: Mapping[str, Any],
        key: str,
        path: str,
        default: int | None,
        minimum: int,
        maximum: int,
        *,
        required: bool = False,
    ) -> int | None:
        where = f"{path}.{key}"
        if key not in m or m[key] is None:
            if required:
                self.fail(where, "required")
            return default
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, f"must be an integer, got {value!r}")
            return default
        if value < minimum:
            self.fail(where, f"must be >= {minimum}, got {value}")
            return default
        if value > maximum:
            self.fail(where, f"must be <= {maximum}, got {value}")
            return default
        return value

    def number(
        self, m: Mapping[str, Any], key: str, path: str, minimum: float, maximum: float
    ) -> float | None:
        where = f"{path}.{key}"
        if key not in m or m[key] is None:
            return None
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(where, f"must be a number, got {value!r}")
            return None
        if not minimum <= value <= maximum:
            self.fail(where, f"must be in [{minimum:g}, {maximum:g}], got {value}")
            return None
        return float(value)

    def string(
        self,
        m: Mapping[str, Any],
        key: str,
        path: str,
        *,
        enum: tuple[str, ...] | None = None,
        min_length: int = 1,
        max_length: int = 1024,
        pattern: re.Pattern[str] | None = None,
        pattern_hint: str | None = None,  # what a match means, in words, for the message
    ) -> str | None:
        where = f"{path}.{key}"
        if key not in m or m[key] is None:
            return None
        value = m[key]
        if not isinstance(value, str):
            self.fail(where, f"must be a string, got {value!r}")
            return None
        if enum is not None and value not in enum:
            self.fail(where, f"must be one of {', '.join(enum)}, got {value!r}")
            return None
        if not min_length <= len(value) <= max_length:
            self.fail(where, f"length must be in [{min_length}, {max_length}], got {len(value)}")
            return None
        if pattern is not None and not pattern.match(value):
            expected = pattern_hint or f"must match {pattern.pattern}"
            self.fail(where, f"{expected}, got {value!r}")
            return None
        return value
