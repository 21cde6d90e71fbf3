"""The router reads every `dsv4 serve` flag the flag table gives it (a row it ignored would be
a flag that does nothing)."""

from __future__ import annotations

import argparse

from dsv4_cli.main import build_parser
from dsv4_common.api.serve_flags import SERVE_FLAGS
from dsv4_router.config import settings_from_args


class Reads(argparse.Namespace):
    """A parsed namespace that records which flags are read."""

    def __init__(self, parsed: argparse.Namespace) -> None:
        super().__init__(**vars(parsed))
        self.__dict__["names"] = set()

    def __getattribute__(self, name: str) -> object:
        if not name.startswith("_") and name != "names":
            object.__getattribute__(self, "names").add(name)
        return object.__getattribute__(self, name)


def test_the_router_reads_its_flags() -> None:
    instances = ["--instance", "prefill=h:1:2:3", "--instance", "decode=h:4:5:6"]
    reads = Reads(build_parser().parse_args(["serve", "--role", "router", *instances]))
    settings_from_args(reads)
    router_dests = {f.dest for f in SERVE_FLAGS if f.reader in ("router", "both")} - {"role"}
    assert reads.names >= router_dests  # --role is read by the command's dispatch
