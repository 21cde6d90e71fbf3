"""Resource quantities as the API server stores them: parsed, then written back in canonical
form. Restated from kubernetes/apimachinery pkg/api/resource (quantity.go ParseQuantity,
CanonicalizeBytes, String, MarshalJSON; amount.go AsCanonicalBytes; suffix.go), independently
of the operator's own parser (dsv4_operator/quantities.py), so that a bug in one shows up against
the other.

The rules, in the order the server applies them:
  parse      `[+-]digits[.digits]` then a suffix: none, a decimal SI one (n u m k M G T P E), a
             binary one (Ki Mi Gi Ti Pi Ei) or a decimal exponent (`e3`, `E-2`); the value is
             exact, rounded up (away from zero) to nano precision when finer
  keep       a value read on the int64 fast path keeps the text it was written as when that text
             is already canonical-looking: binary SI whose number is not a multiple of 8
             (`2Gi` stays, `1024Mi` does not), decimal with an exponent a multiple of 3, no
             trailing `000` and no leading `0` digit (`100m`, `1e3` stay; `1000m`, `0.5` do not)
  canonical  binary SI stays binary only for integers of magnitude >= 1024 (largest exact
             suffix: `1536Mi`, `1Gi`); otherwise decimal: the smallest integer mantissa with an
             exponent that is a multiple of 3 (`0.5` -> `500m`, `1000m` -> `1`, `1000` -> `1k`);
             a decimal exponent stays one (`1000e0` -> `1e3`)
  milli      requests and limits of containers are rounded up to milli precision
             (pkg/apis/core/v1/defaults.go SetDefaults_ResourceList: `100u` -> `1m`)

`1e3` stays `1e3` on a real server (the exponent form is kept, see `keep`), not `1k`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Final, Literal

Format = Literal["DecimalSI", "BinarySI", "DecimalExponent"]

_SUFFIX_CHARS: Final = frozenset("eEinumkKMGTP")
_DECIMAL_SI: Final = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12,
                      "P": 15, "E": 18}  # fmt: skip
_BINARY_SI: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_BY_EXPONENT: Final = {e: s for s, e in _DECIMAL_SI.items()}
_BINARY_BY_POWER: Final = {e // 10: s for s, e in _BINARY_SI.items()}
MAX_BINARY: Final = (1 << 63) - 1  # binary SI values are capped here (maxAllowed)
_NANO: Final = 9  # decimal places kept

FORMAT_MESSAGE: Final = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
SUFFIX_MESSAGE: Final = "unable to parse quantity's suffix"


class QuantityError(ValueError):
    """Not a quantity; the message is the API server's."""


@dataclass(frozen=True)
class Quantity:
    value: Fraction  # exact, a multiple of 1e-9
    fmt: Format
    text: str | None = None  # the text it keeps (see `keep` above); None: written canonically
    scale: int | None = None  # the power of ten of its int64 form (None: read as a decimal)

    def __str__(self) -> str:
        return self.text if self.text is not None else canonical(self.value, self.fmt)


@dataclass(frozen=True)
class _Parts:
    negative: bool
    num: str  # integer digits without leading zeros ("0" when none)
    denom: str  # fraction digits
    suffix: str


def _split(text: str) -> _Parts:
    """parseQuantityString: sign, number, suffix (the suffix is not interpreted yet)."""
    pos, end = 0, len(text)
    negative = False
    if pos < end and text[pos] in "+-":
        negative = text[pos] == "-"
        pos += 1
    while pos < end and text[pos] == "0":
        pos += 1
    if pos >= end:
        return _Parts(negative, "0", "", "")
    start = pos
    while pos < end and text[pos].isdigit():
        pos += 1
    num = text[start:pos] or "0"
    denom = ""
    if pos < end and text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos].isdigit():
            pos += 1
        denom = text[start:pos]
    suffix_start = pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos].isdigit():
        pos += 1
    if pos < end or any(not c.isascii() for c in text):
        raise QuantityError(FORMAT_MESSAGE)
    return _Parts(negative, num, denom, text[suffix_start:])


def _interpret(suffix: str) -> tuple[int, int, Format]:
    """(base, exponent, format) of a suffix (suffix.go interpret)."""
    if suffix in _DECIMAL_SI:
        return 10, _DECIMAL_SI[suffix], "DecimalSI"
    if suffix in _BINARY_SI:
        return 2, _BINARY_SI[suffix], "BinarySI"
    if len(suffix) > 1 and suffix[0] in "eE":
        digits = suffix[1:]
        body = digits[1:] if digits[0] in "+-" else digits
        if body.isdigit() and abs(int(digits)) < 2**31:
            return 10, int(digits), "DecimalExponent"
    raise QuantityError(SUFFIX_MESSAGE)


def parse_quantity(text: str) -> Quantity:
    """ParseQuantity."""
    if not text:
        raise QuantityError(FORMAT_MESSAGE)
    if text == "0":
        return Quantity(Fraction(0), "DecimalSI", "0", 0)
    parts = _split(text)
    base, exponent, fmt = _interpret(parts.suffix)
    sign = -1 if parts.negative else 1
    digits = parts.num + parts.denom
    if fmt == "BinarySI":
        fast = exponent >= 0 and not parts.denom
        precision = 15 - len(parts.num) - (exponent * 3) // 10 - 1 if fast else -1
        scale = 0
    else:
        precision = 18 - len(digits)
        scale = exponent
    if precision >= 0:
        scale -= len(parts.denom)
        if scale >= -_NANO:  # the int64 fast path: exact, and may keep its text
            number = int(digits) * (1 << exponent if fmt == "BinarySI" else 1)
            if number <= MAX_BINARY:
                value = sign * Fraction(number) * Fraction(10) ** scale
                if fmt == "BinarySI":
                    keep = int(digits) & 7 != 0
                else:
                    keep = scale % 3 == 0 and not digits.endswith("000") and digits[0] != "0"
                return Quantity(value, fmt, text if keep else None, scale)
    magnitude = Fraction(int(digits), 10 ** len(parts.denom)) * Fraction(base) ** exponent
    magnitude = _round_up(magnitude, _NANO)
    if fmt == "BinarySI":
        magnitude = min(magnitude, Fraction(MAX_BINARY))
        if 0 < magnitude < 1:
            fmt = "DecimalSI"
    return Quantity(sign * magnitude, fmt)


def _round_up(value: Fraction, places: int) -> Fraction:
    """Rounded away from zero to `places` decimal places (inf.RoundUp)."""
    scaled = abs(value) * 10**places
    rounded = Fraction(math.ceil(scaled), 10**places)
    return rounded if value >= 0 else -rounded


def canonical(value: Fraction, fmt: Format) -> str:
    """CanonicalizeBytes: the text the server writes for a value read in format `fmt`."""
    if value == 0:
        return "0"
    if fmt == "BinarySI" and (abs(value) < 1024 or value.denominator != 1):
        fmt = "DecimalSI"
    sign = "-" if value < 0 else ""
    if fmt == "BinarySI":
        mantissa, power = abs(value.numerator), 0
        while mantissa % 1024 == 0:
            mantissa //= 1024
            power += 1
        return f"{sign}{mantissa}{_BINARY_BY_POWER.get(power, '')}"
    in_nanos = abs(value) * 10**_NANO
    assert in_nanos.denominator == 1, f"{value} is finer than nano precision"
    number, exponent = in_nanos.numerator, -_NANO
    while number % 10 == 0:
        number //= 10
        exponent += 1
    while exponent % 3 != 0:
        number *= 10
        exponent -= 1
    if fmt == "DecimalExponent":
        return f"{sign}{number}" + (f"e{exponent}" if exponent else "")
    # Beyond E (10^18) the server's suffix table has no entry and it writes no suffix.
    return f"{sign}{number}{_DECIMAL_BY_EXPONENT.get(exponent, '')}"


def round_up_milli(q: Quantity) -> Quantity:
    """Quantity.RoundUp(Milli), as SetDefaults_ResourceList applies it: a value finer than
    milli is rounded up and written canonically; an int64 value at milli or coarser is left
    as it is (its text too)."""
    if q.scale is not None and q.scale >= -3:
        return q
    return Quantity(_round_up(q.value, 3), q.fmt)


def from_json(raw: object) -> Quantity:
    """UnmarshalJSON: a JSON string or number (its text; spaces trimmed)."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise QuantityError(FORMAT_MESSAGE)
    if isinstance(raw, float) and not math.isfinite(raw):
        raise QuantityError(FORMAT_MESSAGE)
    return parse_quantity(raw.strip() if isinstance(raw, str) else repr(raw))


def canonical_quantity(raw: object) -> str:
    """The text a JSON quantity is stored as (UnmarshalJSON, then MarshalJSON)."""
    return str(from_json(raw))
