"""`dsv4 serve`: its flags are the rows of `dsv4_common.api.serve_flags`; `--role router` runs
the router (never imports torch), every other role a worker."""

from __future__ import annotations

import argparse

from dsv4_cli.flags import add_flags
from dsv4_cli.usage import Usage
from dsv4_common.api.serve_flags import SERVE_FLAGS


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run a worker: the OpenAI-compatible API over the paged engine",
        description="Serve a model. Quick form: dsv4 serve --model tiny (colocated, one "
        "process; --role prefill|decode|router for a hand-made PD deployment). Deployed form: "
        "dsv4 serve --role R --config-dir DIR (the rank or router config the operator or "
        "dsv4 up renders).",
    )
    add_flags(p, SERVE_FLAGS)


def run(args: argparse.Namespace) -> int:
    if args.role == "router":  # the router never imports torch
        try:
            from dsv4_router.serve import run as run_router
        except ImportError as exc:
            raise Usage(f"needs the router package ({exc}): pip install dsv4-serve") from exc
        return run_router(args)
    try:  # checks the flags before it imports torch (`dsv4_worker.start`)
        from dsv4_worker.start import run as run_worker
    except ImportError as exc:
        raise Usage(f"needs the worker package ({exc}): pip install 'dsv4-serve[worker]'") from exc
    return run_worker(args)
