"""SGLang's command-line flags, from the committed snapshots. Pure; never imports sglang.

The snapshots (package data, `dsv4_operator/data/`) are written by scripts/sglang_flags.py
from SGLang's own parsers:
- server: `argparse.ArgumentParser()` + `sglang.srt.server_args.ServerArgs.add_cli_args`,
  i.e. the argv after `python3 -m sglang.launch_server` (or `sglang serve`);
- router: `argparse.ArgumentParser()` + `sglang_router.router_args.RouterArgs.add_cli_args(
  parser, use_router_prefix=False)`, what `python3 -m sglang_router.launch_router` parses.

The rebuilt parsers reproduce argparse parsing (see `snapshot` for the exact limits).
Of SGLang's post-processing only the router's `--prefill URL [BOOTSTRAP_PORT]` rule is
reproduced (`router_prefill_urls`). The server's post-processing (`ServerArgs.resolve_once`,
~60 hooks, most reading the model's config.json and the platform) is not: the opt-in test
operator/tests/test_sglang_real.py runs it with the real package (on a DeepSeek-V4
config.json, with `--device cpu` appended: it needs an accelerator otherwise). NOTE: for
DeepseekV4ForCausalLM it sets page_size to 256 whatever `--page-size` says.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, NamedTuple

from dsv4_operator.flavors.sglang.snapshot import (
    SglangArgsError,
    SnapshotParser,
    build_parser,
    build_recorder,
    type_is_checked,
)

SGLANG_VERSION = "0.5.23"
ROUTER_VERSION = "0.3.2"
SERVER_SNAPSHOT = f"sglang-{SGLANG_VERSION}-server-flags.json"
ROUTER_SNAPSHOT = f"sglang-router-{ROUTER_VERSION}-flags.json"
SERVER_ENTRY = ("python3", "-m", "sglang.launch_server")
ROUTER_ENTRY = ("python3", "-m", "sglang_router.launch_router")

__all__ = [
    "ROUTER_ENTRY",
    "ROUTER_VERSION",
    "SERVER_ENTRY",
    "SGLANG_VERSION",
    "FlagInfo",
    "FlagUse",
    "SglangArgsError",
    "load_snapshot",
    "parse_router_args",
    "parse_server_args",
    "router_flag",
    "router_prefill_urls",
    "server_flag",
    "split_flags",
    "split_router_flags",
]


@dataclass(frozen=True)
class FlagInfo:
    """One flag of a snapshot. `option_strings[0]` is the canonical spelling."""

    option_strings: tuple[str, ...]
    dest: str
    action: str  # store, store_true, append, boolean_optional, custom, ... (argparse's kinds)
    type: str | None  # str, int, float, json, human_readable_int, ... (None: no conversion)
    nargs: int | str | None
    choices: tuple[Any, ...] | None
    default: Any
    required: bool

    @property
    def name(self) -> str:
        return self.option_strings[0]

    @property
    def takes_value(self) -> bool:
        """Whether the flag consumes argument words (`--flag=value` / `--flag value`)."""
        return self.nargs != 0

    @property
    def type_checked(self) -> bool:
        """Whether the rebuilt parser converts values like SGLang (else the string is kept)."""
        return type_is_checked(self.type)


class FlagUse(NamedTuple):
    """One flag occurrence in an argv: the option as argparse resolved it (full spelling,
    also for abbreviations), its raw value words, and the flag."""

    option: str
    values: tuple[str, ...]
    info: FlagInfo


# ---- snapshots --------------------------------------------------------------------------

# snapshot file -> the program name errors use
_PROGS = {SERVER_SNAPSHOT: "sglang.launch_server", ROUTER_SNAPSHOT: "sglang_router.launch_router"}


@cache
def load_snapshot(filename: str) -> Mapping[str, Any]:
    """A snapshot document from the package data (see snapshot.snapshot_parser)."""
    text = resources.files("dsv4_operator").joinpath("data", filename).read_text("utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


@cache
def _flags(filename: str) -> Mapping[str, FlagInfo]:
    """Every option string of a snapshot -> its flag."""
    table: dict[str, FlagInfo] = {}
    for entry in load_snapshot(filename)["actions"]:
        info = FlagInfo(
            option_strings=tuple(entry["option_strings"]),
            dest=entry["dest"],
            action=entry["action"],
            type=entry["type"],
            nargs=entry["nargs"],
            choices=None if entry["choices"] is None else tuple(entry["choices"]),
            default=entry["default"],
            required=entry["required"],
        )
        table.update(dict.fromkeys(info.option_strings, info))
    return table


@cache
def _parser(filename: str) -> SnapshotParser:
    return build_parser(load_snapshot(filename), _PROGS[filename])


@cache
def _recorder(filename: str) -> SnapshotParser:
    return build_recorder(load_snapshot(filename), _PROGS[filename])


# ---- public API -------------------------------------------------------------------------


def server_flag(name: str) -> FlagInfo | None:
    """The launch_server flag spelled exactly `name` (`--flag` or `--flag=value`; no
    abbreviations: `split_flags` resolves those like argparse), or None."""
    return _flags(SERVER_SNAPSHOT).get(name.split("=", 1)[0])


def router_flag(name: str) -> FlagInfo | None:
    """As `server_flag`, for sglang_router.launch_router."""
    return _flags(ROUTER_SNAPSHOT).get(name.split("=", 1)[0])


def parse_server_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like SGLang 0.5.23's launch_server parser; `SglangArgsError` names the flag."""
    return _parse(_parser(SERVER_SNAPSHOT), argv)


def parse_router_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like sglang-router 0.3.2's launch_router, including its check of the
    `--prefill URL [BOOTSTRAP_PORT]` words (see `router_prefill_urls`)."""
    namespace = _parse(_parser(ROUTER_SNAPSHOT), argv)
    router_prefill_urls(namespace)
    return namespace


def split_flags(argv: Sequence[str]) -> list[FlagUse]:
    """The launch_server flags `argv` sets, in order, split exactly as argparse splits them
    (abbreviations, `--flag=value`, nargs). Values are raw words; nothing is type-checked
    and required flags may be absent. Unknown or ambiguous flags raise `SglangArgsError`."""
    return _split(SERVER_SNAPSHOT, argv)


def split_router_flags(argv: Sequence[str]) -> list[FlagUse]:
    """As `split_flags`, for sglang_router.launch_router."""
    return _split(ROUTER_SNAPSHOT, argv)


def router_prefill_urls(namespace: argparse.Namespace) -> list[tuple[str, int | None]]:
    """`RouterArgs._parse_prefill_urls`: each `--prefill` is URL [BOOTSTRAP_PORT], the port
    an integer or "none" (any case); absent means None; further words are ignored."""
    urls: list[tuple[str, int | None]] = []
    for words in getattr(namespace, "prefill", None) or []:
        port: int | None = None
        if len(words) >= 2 and words[1].lower() != "none":
            try:
                port = int(words[1])
            except ValueError:
                raise SglangArgsError(
                    f"--prefill {words[0]}: invalid bootstrap port {words[1]!r} "
                    "(a number or 'none')",
                    flag="--prefill",
                ) from None
        urls.append((words[0], port))
    return urls


# ---- helpers ----------------------------------------------------------------------------


def _parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    namespace: argparse.Namespace | None = None,
) -> argparse.Namespace:
    try:
        return parser.parse_args(list(argv), namespace)
    except argparse.ArgumentError as err:  # exit_on_error=False: type and choice errors
        flag = err.argument_name.split("/")[0] if err.argument_name else None
        raise SglangArgsError(f"{parser.prog}: {err}", flag=flag) from None


def _split(filename: str, argv: Sequence[str]) -> list[FlagUse]:
    namespace = _parse(_recorder(filename), argv, argparse.Namespace(uses=[]))
    flags = _flags(filename)
    return [FlagUse(option, values, flags[option]) for option, values in namespace.uses]
