"""Kubernetes resource quantities (`500m`, `1Gi`, `2`, `1e3`) as exact numbers, so a value the
operator planned (`0.5`, `1024Mi`) is recognized in the canonical form the API server stores
(`500m`, `1Gi`). Grammar: apimachinery's resource.Quantity: a signed decimal number, then a
binary-SI suffix (Ki..Ei), a decimal-SI suffix (n, u, m, k, M..E) or a decimal exponent (e3).
Pure.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$"
)


def parse(value: object) -> Fraction | None:
    """The exact value of a quantity (a string, an int or a float), or None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    if not isinstance(value, str):
        return None
    match = _QUANTITY.match(value.strip())
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    base = Fraction(number)
    if exponent is not None:
        return base * Fraction(10) ** int(exponent[1:])
    if suffix in _BINARY:
        return base * _BINARY[suffix]
    return base * _DECIMAL[suffix or ""]


def equal(a: object, b: object) -> bool:
    """Both are quantities of the same value (`0.5` == `500m`, `1024Mi` == `1Gi`)."""
    x, y = parse(a), parse(b)
    return x is not None and x == y
