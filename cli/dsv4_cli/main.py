"""The `dsv4` command line. Parses arguments, calls the subcommand, prints; no decisions here.
Every bad input exits 2 with a message naming the flag or field, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from dsv4_cli import fetch, plan, render, serve, up
from dsv4_cli.usage import Usage

# Exit code of a process killed by SIGPIPE, as shells report it (`yes | head -1`).
EXIT_BROKEN_PIPE = 128 + 13

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "fetch": fetch.run,
    "plan": plan.run,
    "render": render.run,
    "serve": serve.run,
    "up": up.run,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="dsv4-serve command line")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (plan, render, serve, up, fetch):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except Usage as exc:
        print(f"dsv4 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`dsv4 plan --json | head -1`): stop quietly, as Unix tools do.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
