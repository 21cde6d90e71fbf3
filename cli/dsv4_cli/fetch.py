"""`dsv4 fetch`: a model from the Hugging Face hub into the local cache (`dsv4_fetch`); the
operator's download Job runs it too."""

from __future__ import annotations

import argparse

from dsv4_cli.flags import bounded
from dsv4_cli.usage import Usage
from dsv4_common.api.serve_flags import PORT, Bounds

WORKERS = Bounds("int", 1, True, 64)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fetch",
        help="download a model from the Hugging Face hub into the local cache, verified",
        description="Resolve hf://ORG/NAME[@REVISION] to a commit, download its files into the "
        "Hugging Face cache (resuming partial files), check each file's size and hash against "
        "the hub's listing and the checkpoint's tensors against the plan, and print the "
        "snapshot's directory. Exit 0 when complete, 3 when a retry cannot help, 1 when it can.",
    )
    p.add_argument("source", help="hf://ORG/NAME[@REVISION] (a branch, tag or commit; main)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="the Hugging Face cache to fill (default: HF_HUB_CACHE, else "
        "~/.cache/huggingface/hub)",
    )
    p.add_argument(
        "--endpoint",
        default=None,
        help="the hub's URL or a mirror's (default: HF_ENDPOINT, else https://huggingface.co); "
        "the token is HF_TOKEN, else the one `hf auth login` saved",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="no network: succeed only when the cache holds the revision, complete and verified",
    )
    p.add_argument("--workers", type=bounded(WORKERS), default=8, help="files at once (8)")
    p.add_argument(
        "--progress",
        choices=("auto", "bar", "log", "none"),
        default="auto",
        help="on stderr: a bar (default on a terminal), a line each 10%% (log), or none",
    )
    p.add_argument(
        "--progress-port", type=bounded(PORT), default=None, help="serve GET /progress here"
    )
    p.add_argument("--progress-host", default="0.0.0.0", help="with --progress-port")
    p.add_argument("--termination-log", default=None, help="write the final document here")
    p.add_argument("--json", action="store_true", help="print the final document, not the path")


def run(args: argparse.Namespace) -> int:
    try:
        from dsv4_fetch.run import run as run_fetch
    except ImportError as exc:
        raise Usage(f"needs huggingface_hub ({exc}): pip install 'dsv4-serve[worker]'") from exc
    return run_fetch(args)
