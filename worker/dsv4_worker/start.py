"""`dsv4 serve` for a worker role, in two steps: the options and every check that needs no
torch (`options`, `precheck`: a mistake exits 2 within a second, naming its flag), then torch,
the weights and the engine (`serve`). This module imports no torch itself."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dsv4_router.listen_sockets import raise_fd_limit
from dsv4_worker.options import ServeError, load_options
from dsv4_worker.precheck import precheck

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise_fd_limit()  # before the apps size their connection bound from it
    try:
        opts = load_options(args, os.environ)
        checked = precheck(opts)
    except ServeError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        from dsv4_worker.serve import run as serve  # torch from here on
    except ImportError as exc:
        print(
            f"dsv4 serve: error: needs the worker package ({exc}): pip install "
            "'dsv4-serve[worker]'",
            file=sys.stderr,
        )
        return 2
    return serve(opts, checked)
