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
    if args.role != "router" and args.config_dir is None:
        _fetch_hf_model(args)  # before the worker (and torch) is imported
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


def _fetch_hf_model(args: argparse.Namespace) -> None:
    """`--model hf://ORG/NAME[@REV]`: a bad reference fails at once (exit 2); else the snapshot
    is fetched into the local Hugging Face cache (`--offline`: only taken from it), with a
    progress bar, and `--model` becomes its directory, served under the repo id unless
    `--served-model-name` says otherwise."""
    if not str(args.model).startswith("hf://"):
        if args.offline:
            raise Usage("--offline: applies to --model hf://ORG/NAME only")
        return
    from dsv4_common.api.model_source import SourceError

    try:
        from dsv4_fetch.run import fetch_for_serve, parse_hf
    except ImportError as exc:
        raise Usage(f"--model hf://: needs huggingface_hub ({exc})") from exc
    try:
        source = parse_hf(args.model)
    except SourceError as exc:
        raise Usage(f"--model: {exc}") from exc
    path, problem = fetch_for_serve(source, offline=args.offline)
    if path is None:
        raise Usage(f"--model {args.model}: {problem}")
    args.model = str(path)
    if not args.served_model_name:
        args.served_model_name = [source.repo_id]
