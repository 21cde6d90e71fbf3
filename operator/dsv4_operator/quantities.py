"""Kubernetes resource quantities ("500m", "4Gi", "1e3") as numbers, to compare a request with
its limit. Pure.
"""

from __future__ import annotations

import re
from decimal import ROUND_UP, Decimal, InvalidOperation, localcontext
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
        with localcontext() as context:  # exact: the default 28 digits would round the product
            context.prec = len(number) + 2 * len(str(scale)) + 8
            return Decimal(number) * scale
    except InvalidOperation:
        return None


NANO: Final = 9  # the API server keeps every quantity to this many decimal places
MILLI: Final = 3  # and the requests and limits of containers to this many


def stored_value(value: Decimal, places: int = NANO) -> Decimal:
    """`value` as the API server stores it: rounded up (away from zero) to `places` decimal
    places (apimachinery ParseQuantity: nano; SetDefaults_ResourceList: milli)."""
    if not value.is_finite() or value.adjusted() > 100:  # past any amount: a whole number
        return value
    with localcontext() as context:
        context.prec = max(context.prec, value.adjusted() + places + 3)
        return value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_UP)


def same_quantity(a: object, b: object, places: int = NANO) -> bool:
    """Both are quantities of the same stored value (`0.5` == `500m`, `1024Mi` == `1Gi`; with
    `places=MILLI`, `100u` == `1m`): how a value the operator planned is recognized in the
    canonical form the API server stores."""
    x, y = quantity(a), quantity(b)
    return x is not None and y is not None and stored_value(x, places) == stored_value(y, places)
