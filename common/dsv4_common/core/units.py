"""Byte units, defined once, and the one human format for byte counts. Pure."""

from __future__ import annotations

from typing import Final

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30


def format_bytes(num_bytes: float) -> str:
    """`12.3 GiB`, `4.0 MiB`, `512 B`: three significant figures at least, never `0.0 GiB`
    for a non-zero count."""
    size = abs(num_bytes)
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return (
                f"{num_bytes / scale:.1f} {unit}"
                if size >= 10 * scale
                else (f"{num_bytes / scale:.2f} {unit}")
            )
    return f"{num_bytes:.0f} B"
