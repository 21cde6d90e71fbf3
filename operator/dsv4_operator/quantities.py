"""Kubernetes resource quantities ("500m", "4Gi", "1e3") as numbers, to compare a request with
its limit. Pure.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Final

_QUANTITY: Final = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:[eE]([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$"
)
_SUFFIX: Final = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{
        s: Decimal(10) ** e
        for s, e in zip("numkMGTPE", (-9, -6, -3, 3, 6, 9, 12, 15, 18), strict=True)
    },
}


def quantity(value: object) -> Decimal | None:
    """A Kubernetes resource quantity as a number (None when it is not one)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Decimal(str(value))
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    try:
        scale = Decimal(10) ** int(exponent) if exponent else _SUFFIX.get(suffix or "", Decimal(1))
        return Decimal(number) * scale
    except InvalidOperation:
        return None


def same_quantity(a: object, b: object) -> bool:
    """Both are quantities of the same value (`0.5` == `500m`, `1024Mi` == `1Gi`): how a value
    the operator planned is recognized in the canonical form the API server stores."""
    x, y = quantity(a), quantity(b)
    return x is not None and x == y
