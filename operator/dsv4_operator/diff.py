"""Comparisons that keep the reconciler from writing what the cluster already holds: does a live
object still hold every field we planned, and what merge patch turns one status into another.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4_operator import labels as L
from dsv4_operator.quantities import MILLI, NANO, same_quantity

# Maps whose values are resource quantities (the API server stores them canonically); a
# container's requests and limits are also rounded up to milli precision.
_QUANTITY_MAPS = frozenset({"requests", "limits", "capacity", "allocatable", "hard"})
_MILLI_MAPS = frozenset({"requests", "limits"})
_QUANTITY_KEYS = frozenset({"sizeLimit", "storage"})
# Keys that identify the items of keyed lists (containers, env, volumes, ports...): the server
# merges such lists per item and keeps items another manager (a webhook, a sidecar injector)
# added, so a live list may hold more items than we planned.
_ITEM_KEYS = ("name", "containerPort", "mountPath", "devicePath", "ip")


def holds(live: object, desired: object, *, quantity: bool = False) -> bool:
    """True when `live` contains `desired` as a real API server would store it: every planned
    map key with an equal value (quantities compared by the value the server stores: `0.5` ==
    `500m`, and a container's requests and limits rounded up to milli: `100u` == `1m`); keyed lists
    (items with a name, containerPort, mountPath...) item by item, extra live items allowed;
    other lists element-wise with equal length (the server adds defaults inside elements).
    `quantity`: `desired` is a resource quantity."""
    if quantity:
        return _same_quantity(live, desired, NANO)
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(k in live and _field_holds(k, live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and _list_holds(live, desired)
    return live == desired


def _field_holds(key: str, live: object, desired: object) -> bool:
    if key in _QUANTITY_KEYS:
        return holds(live, desired, quantity=True)
    if key in _QUANTITY_MAPS and isinstance(desired, Mapping):
        places = MILLI if key in _MILLI_MAPS else NANO
        return isinstance(live, Mapping) and all(
            k in live and _same_quantity(live[k], v, places) for k, v in desired.items()
        )
    return holds(live, desired)


def _same_quantity(live: object, desired: object, places: int) -> bool:
    return live == desired or same_quantity(live, desired, places)


def _list_holds(live: list[Any], desired: list[Any]) -> bool:
    key = _item_key(desired)
    if key is None:
        return len(live) == len(desired) and all(
            holds(a, b) for a, b in zip(live, desired, strict=True)
        )
    by_key = {item.get(key): item for item in live if isinstance(item, Mapping)}
    return all(holds(by_key.get(item[key]), item) for item in desired)


def _item_key(items: list[Any]) -> str | None:
    """The key every item of a keyed list carries (None: not a keyed list)."""
    if not items or not all(isinstance(item, Mapping) for item in items):
        return None
    for key in _ITEM_KEYS:
        values = [item.get(key) for item in items]
        if all(v is not None for v in values) and len(set(map(str, values))) == len(values):
            return key
    return None


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
