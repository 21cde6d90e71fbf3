#!/usr/bin/env python3
"""Write (or --check) the snapshots of SGLang's and sglang-router's command-line flags that the
operator ships in operator/dsv4_operator/data/ (see dsv4_operator/flavors/sglang/flags.py).

It imports the real parsers, so run it with a Python where they import. The main .venv
cannot (it must not get sglang); make a throwaway one (about 2.5 GB, 1-2 minutes here):

    python3 -m venv /tmp/sglenv
    /tmp/sglenv/bin/pip install torch==2.13.0 numpy orjson psutil pybase64 requests tqdm \\
        triton packaging pillow starlette msgspec pyzmq ipython pydantic aiohttp \\
        setproctitle uvicorn fastapi
    /tmp/sglenv/bin/pip install --no-deps sglang==0.5.23 sglang-router==0.3.2
    /tmp/sglenv/bin/python scripts/sglang_flags.py          # rewrite the snapshots
    /tmp/sglenv/bin/python scripts/sglang_flags.py --check  # exit 1 if they differ

torch is pinned to 2.13.0 in the same pip command so pip takes the CPU wheel that lies on disk
here (pip's configured find-links, /opt/wheels, as for .venv; elsewhere add
`--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple`).
sglang itself wants torch 2.14.1 with CUDA; --no-deps keeps pip from following that. The list
is what `import sglang.srt.server_args` and `import sglang_router.launch_router` need, found by
trying.

SGLANG_* environment variables are cleared before sglang is imported: some choice lists
depend on them (`--sampling-backend` on SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("dsv4_operator") is None:  # the throwaway venv: use the tree
    # (sglang flags, snapshot: stdlib; the flavors package imports the shared package)
    sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "common")]

from dsv4_operator.flavors.sglang.flags import (  # noqa: E402
    ROUTER_SNAPSHOT,
    ROUTER_VERSION,
    SERVER_SNAPSHOT,
    SGLANG_VERSION,
)
from dsv4_operator.flavors.sglang.snapshot import snapshot_parser  # noqa: E402

DATA = ROOT / "operator" / "dsv4_operator" / "data"
SERVER_SOURCE = "argparse.ArgumentParser(); sglang.srt.server_args.ServerArgs.add_cli_args(parser)"
ROUTER_SOURCE = (
    "argparse.ArgumentParser(); sglang_router.router_args.RouterArgs.add_cli_args("
    "parser, use_router_prefix=False)  # as sglang_router.launch_router.parse_router_args"
)


def real_server_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def real_router_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def installed_version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def snapshots() -> dict[str, dict[str, Any]]:
    """File name -> snapshot document, from the installed packages (versions checked)."""
    for dist, want in (("sglang", SGLANG_VERSION), ("sglang-router", ROUTER_VERSION)):
        have = installed_version(dist)
        if have != want:
            raise SystemExit(f"{dist} {have} is installed; the snapshot is for {want}")
    return {
        SERVER_SNAPSHOT: snapshot_parser(
            real_server_parser(),
            package="sglang",
            version=SGLANG_VERSION,
            source=SERVER_SOURCE,
            generator="scripts/sglang_flags.py",
        ),
        ROUTER_SNAPSHOT: snapshot_parser(
            real_router_parser(),
            package="sglang-router",
            version=ROUTER_VERSION,
            source=ROUTER_SOURCE,
            generator="scripts/sglang_flags.py",
        ),
    }


def render(doc: dict[str, Any]) -> str:
    """The committed text of a snapshot: valid JSON, sorted keys, one action per line (in
    the parser's order), so a version bump diffs flag by flag."""

    def dump(value: Any) -> str:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)

    head = [f" {dump(k)}: {dump(v)}," for k, v in sorted(doc.items()) if k != "actions"]
    actions = ",\n".join(f"  {dump(a)}" for a in doc["actions"])
    return "{\n" + "\n".join(head) + f'\n "actions": [\n{actions}\n ]\n}}\n'


def main(argv: list[str]) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--check", action="store_true", help="compare instead of writing")
    args = cli.parse_args(argv)
    for key in [k for k in os.environ if k.startswith("SGLANG_")]:
        del os.environ[key]
    status = 0
    for name, doc in snapshots().items():
        path = DATA / name
        text = render(doc)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)} ({len(doc['actions'])} actions)")
            continue
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if old != text:
            status = 1
            diff = difflib.unified_diff(
                old.splitlines(), text.splitlines(), str(path), "generated", lineterm=""
            )
            print("\n".join(list(diff)[:200]))
        else:
            print(f"{path.relative_to(ROOT)} is up to date")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
