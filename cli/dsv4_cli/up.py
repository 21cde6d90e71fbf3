"""`dsv4 up`: a DSV4Deployment as local processes on 127.0.0.1 (`dsv4_local`)."""

from __future__ import annotations

import argparse

from dsv4_cli.flags import bounded
from dsv4_cli.usage import Usage
from dsv4_common.api.serve_flags import PORT, POSITIVE_FLOAT, POSITIVE_INT


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="run a DSV4Deployment as local processes (router, prefill, decode) on 127.0.0.1",
        description="Plan a DSV4Deployment with the shared planner, render the same rank "
        "configs the operator would, start one process per replica and PP rank on "
        "127.0.0.1, wait until every one is ready, print every API and status URL, restart "
        "a process that exits (its whole PP group) with backoff within a budget, and stop "
        "them all on Ctrl-C / SIGTERM.",
    )
    p.add_argument("file", help="YAML file holding one DSV4Deployment")
    p.add_argument(
        "--port",
        type=bounded(PORT),
        default=None,
        help="router port (default: the CR's spec.router.port)",
    )
    p.add_argument(
        "--timeout-s",
        type=bounded(POSITIVE_FLOAT),
        default=300.0,
        help="how long to wait for every process to be ready",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where configs and logs go, kept after the run (default: a fresh temporary "
        "directory, removed at a clean exit)",
    )
    p.add_argument(
        "--request",
        default=None,
        metavar="PROMPT",
        help="once ready, send one completion with this prompt, print it and stop",
    )
    p.add_argument("--max-tokens", type=bounded(POSITIVE_INT), default=16, help="with --request")
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="the API key every process wants (clients send Authorization: Bearer KEY); "
        "required when the CR names spec.apiKey.secretRef (default: $DSV4_API_KEY)",
    )
    p.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep the temporary work directory (configs, logs, status.json) after a clean "
        "exit; it is kept anyway after a failure, and --workdir always is",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="an hf:// spec.model.source comes from the local Hugging Face cache only (a "
        "snapshot dsv4 fetch or an earlier dsv4 up completed), never the network",
    )


def run(args: argparse.Namespace) -> int:
    try:
        from dsv4_local.up import run as run_up
    except ImportError as exc:
        raise Usage(f"needs the local launcher package ({exc}): pip install dsv4-serve") from exc
    return run_up(args, missing_gpu=_missing_gpu)


def _missing_gpu() -> str:
    """Why this machine has no CUDA device for a GPU deployment ("": it has one): the worker's
    probe, which imports no torch."""
    from dsv4_worker.devices import cuda_devices

    return cuda_devices().missing
