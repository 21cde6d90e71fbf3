"""The machine-readable line a bench prints with `--json`, and its parser (for bench/compare.py).

One line per run, anywhere in stdout:

    @bench-json {"bench": "alloc", "figures": [{"name": ..., "value": ..., "unit": "us",
                                               "better": "lower"}, ...]}

`better` says which way is an improvement ("lower" for times, "higher" for throughputs), so a
ratio table can say whether HEAD/BASE > 1 is good. Pure apart from `emit`'s print.
"""

from __future__ import annotations

import json
from typing import Literal, NamedTuple

PREFIX = "@bench-json "
Better = Literal["lower", "higher"]


class Figure(NamedTuple):
    name: str
    value: float
    unit: str
    better: Better


class BenchParseError(ValueError):
    """A bench's output holds no well-formed `@bench-json` line."""


def emit(bench: str, figures: list[Figure]) -> None:
    doc = {"bench": bench, "figures": [f._asdict() for f in figures]}
    print(PREFIX + json.dumps(doc), flush=True)


def parse(stdout: str) -> dict[str, Figure]:
    """The figures of the last `@bench-json` line of `stdout`, by name."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(PREFIX)]
    if not lines:
        raise BenchParseError("no @bench-json line in the bench's output (was --json passed?)")
    try:
        doc = json.loads(lines[-1][len(PREFIX) :])
        figures = [
            Figure(str(f["name"]), float(f["value"]), str(f["unit"]), f["better"])
            for f in doc["figures"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchParseError(f"malformed @bench-json line: {exc}") from exc
    for f in figures:
        if f.better not in ("lower", "higher"):
            raise BenchParseError(f"figure {f.name!r}: better must be lower or higher")
    return {f.name: f for f in figures}
