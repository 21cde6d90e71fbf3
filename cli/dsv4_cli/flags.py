"""argparse from the flag rows of `dsv4_common.api.serve_flags`: a row's bounds become a type
that exits 2 naming the flag, its group a `--help` section (made where it first appears)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import Any

from dsv4_common.api.serve_flags import Bounds, Flag


def bounded(bounds: Bounds) -> Callable[[str], int | float]:
    """An argparse type: parse `bounds.kind`, require a finite value >= minimum (> when not
    inclusive) and <= maximum."""
    kind: type[int] | type[float] = int if bounds.kind == "int" else float
    noun = "an integer" if kind is int else "a number"
    minimum, maximum = bounds.minimum, bounds.maximum
    bound = f">= {minimum:g}" if bounds.inclusive else f"> {minimum:g}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not (value >= minimum if bounds.inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value:g}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {value:g}")
        return value

    return parse


def add_flag(parser: argparse._ActionsContainer, flag: Flag) -> None:
    kwargs: dict[str, Any] = {"default": flag.default}
    if flag.help is not None:
        kwargs["help"] = flag.help
    if flag.bounds is not None:
        kwargs["type"] = bounded(flag.bounds)
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if flag.switch:
        kwargs["action"] = "store_true"
    if flag.many == "one_or_more":
        kwargs["nargs"] = "+"
    elif flag.many == "repeat":  # each use appends to a fresh copy of the (tuple) default
        assert isinstance(flag.default, tuple), f"{flag.name}: a repeated flag's default is a tuple"
        kwargs["action"] = "append"
        kwargs["default"] = list(flag.default)
    parser.add_argument(flag.name, **kwargs)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Every row in order; a row's group is the `--help` section of that title."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags:
        if flag.group is None:
            add_flag(parser, flag)
            continue
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        add_flag(groups[flag.group], flag)
