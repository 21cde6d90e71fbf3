"""Comparisons that keep the reconciler from writing what the cluster already holds: does a live
object still hold every field we planned, and what merge patch turns one status into another.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4_operator import labels as L


def holds(live: object, desired: object) -> bool:
    """True when `live` contains `desired`: every planned map key with an equal value; lists
    element-wise with equal length (the API server adds defaults inside elements, not
    elements)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            k in live and holds(live[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(holds(a, b) for a, b in zip(live, desired, strict=True))
        )
    return live == desired


def needs_apply(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """Apply when the object is missing, was planned differently (a field we no longer set is
    only dropped by applying), or drifted (someone edited a field we own)."""
    if live is None:
        return True
    want = desired["metadata"].get("annotations", {}).get(L.APPLIED_HASH_ANNOTATION)
    have = (live.get("metadata", {}).get("annotations") or {}).get(L.APPLIED_HASH_ANNOTATION)
    return want != have or not holds(live, desired)


def status_patch(
    current: Mapping[str, Any], new: Mapping[str, Any], keys: tuple[str, ...]
) -> dict[str, Any] | None:
    """The JSON merge patch for `status` (None when nothing changed). Keys we own that are no
    longer set are nulled; keys we do not own are left alone."""
    patch: dict[str, Any] = {}
    for key in keys:
        if key in new:
            if current.get(key) != new[key]:
                patch[key] = new[key]
        elif key in current:
            patch[key] = None
    return patch or None
