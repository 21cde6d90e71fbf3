"""What every subcommand shares: the bad-input error and the one way to print a result."""

from __future__ import annotations

import sys


class Usage(Exception):
    """A bad input: printed as `dsv4 <command>: error: ...`, exit code 2."""


def write(text: str, *, newline: bool = True) -> None:
    sys.stdout.write(text + ("\n" if newline else ""))
    sys.stdout.flush()
