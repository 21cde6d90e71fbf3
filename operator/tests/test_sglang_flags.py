"""The committed snapshots of SGLang 0.5.23's and sglang-router 0.3.2's flags, and the parsers
rebuilt from them (no sglang needed): they ship as package data, the representative command
lines parse to the right values, bad ones are refused naming the flag, argv splitting follows
argparse, and the generator's parser -> JSON -> parser round trip is exact on a small parser.
test_sglang_real.py (opt-in, marker `sglang`) checks the same against the real packages."""

from __future__ import annotations

import argparse
import json
import tomllib
from importlib import resources
from typing import Any

import pytest
import sglang_cmdlines as C
from repo_paths import ROOT

from dsv4_operator.flavors.sglang import flags as F
from dsv4_operator.flavors.sglang.snapshot import (
    SglangArgsError,
    build_parser,
    human_readable_int,
    snapshot_parser,
    type_name,
)

# ---- the snapshots ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "package", "version", "at_least"),
    [
        (F.SERVER_SNAPSHOT, "sglang", F.SGLANG_VERSION, 500),
        (F.ROUTER_SNAPSHOT, "sglang-router", F.ROUTER_VERSION, 90),
    ],
)
def test_snapshot_ships_as_package_data(
    filename: str, package: str, version: str, at_least: int
) -> None:
    text = resources.files("dsv4_operator").joinpath("data", filename).read_text("utf-8")
    doc = json.loads(text)
    assert (doc["package"], doc["version"], doc["format"]) == (package, version, 1)
    assert len(doc["actions"]) >= at_least
    options = [o for a in doc["actions"] for o in a["option_strings"]]
    assert len(options) == len(set(options))
    # The text is exactly what the generator writes for this content (so a regenerated
    # snapshot diffs flag by flag, and hand edits show up).
    assert C.load_generator().render(doc) == text


def test_pyproject_ships_the_snapshots() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "data/*.json" in pyproject["tool"]["setuptools"]["package-data"]["dsv4_operator"]


# ---- launch_server ---------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_representative_server_command_line_parses(role: str) -> None:
    args = F.parse_server_args(C.server_argv(role))
    want = {**C.SERVER_VALUES, "disaggregation_mode": role}
    assert {dest: getattr(args, dest) for dest in want} == want
    assert args.enable_dp_attention is False and args.dp_size == 1  # untouched defaults


@pytest.mark.parametrize("flag", [w for w in C.server_argv() if w.startswith("--")])
def test_every_rendered_flag_exists_under_its_own_name(flag: str) -> None:
    info = F.server_flag(flag)
    assert info is not None and info.name == flag
    assert info.type_checked


@pytest.mark.parametrize(("argv", "flag"), C.BAD_SERVER)
def test_bad_server_command_lines_are_refused_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(SglangArgsError) as err:
        F.parse_server_args(argv)
    assert err.value.flag == flag
    assert flag in str(err.value)


def test_help_is_refused_not_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SglangArgsError, match="--help"):
        F.parse_server_args(["--model-path", "/m", "--help"])
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("words", "dest", "value"),
    [
        (["--max-total-tokens", "64Ki"], "max_total_tokens", 65536),
        (["--context-length", "1.5k"], "context_length", 1500),
        (["--chunked-prefill-size", "-1"], "chunked_prefill_size", -1),  # -1: chunking off
        (["--tensor-parallel-size=4"], "tp_size", 4),  # alias, = form
        (["--tp", "4"], "tp_size", 4),  # unique prefix: argparse (allow_abbrev) takes it
        (["--no-enable-tf32-matmul"], "enable_tf32_matmul", False),
        (["--enable-tf32-matmul"], "enable_tf32_matmul", True),
        (["--forward-hooks", '["a", 1]'], "forward_hooks", ["a", 1]),  # json_list_type
        (["--quantization-param-path", "None"], "quantization_param_path", None),
    ],
)  # fmt: skip
def test_server_values_convert_like_sglang(words: list[str], dest: str, value: Any) -> None:
    args = F.parse_server_args(["--model-path", "/m", *words])
    assert getattr(args, dest) == value


def test_server_flag_lookup() -> None:
    info = F.server_flag("--tensor-parallel-size=16")
    assert info is not None and (info.name, info.dest, info.type) == ("--tp-size", "tp_size", "int")
    mode = F.server_flag("--disaggregation-mode")
    assert mode is not None and mode.choices == ("decode", "null", "prefill")
    assert mode.default == "null" and mode.takes_value
    metrics = F.server_flag("--enable-metrics")
    assert metrics is not None and not metrics.takes_value and metrics.action == "store_true"
    assert F.server_flag("--tp") is None  # exact spellings only
    assert F.server_flag("--no-such-flag") is None
    assert F.server_flag("--pp-layer-partition") is None  # SGLANG_PP_LAYER_PARTITION (env)


def test_split_flags_follows_argparse() -> None:
    uses = F.split_flags(
        [
            "--tp=8",
            "--enable-metrics",
            "--max-total-tok", "1k",
            "--no-enable-tf32-matmul",
            "--chunked-prefill-size", "-1",
            "--lora-paths", "a", "b",
            "--model", "/m",
        ]
    )  # fmt: skip
    assert [(u.option, u.values, u.info.dest) for u in uses] == [
        ("--tp-size", ("8",), "tp_size"),
        ("--enable-metrics", (), "enable_metrics"),
        ("--max-total-tokens", ("1k",), "max_total_tokens"),
        ("--no-enable-tf32-matmul", (), "enable_tf32_matmul"),
        ("--chunked-prefill-size", ("-1",), "chunked_prefill_size"),
        ("--lora-paths", ("a", "b"), "lora_paths"),
        ("--model", ("/m",), "model_path"),
    ]
    assert F.split_flags([]) == []


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--no-such-flag"], "--no-such-flag"),
        (["--enable-"], "--enable-"),
        (["--pp-size"], "--pp-size"),
    ],
)
def test_split_flags_refuses_what_argparse_refuses(argv: list[str], flag: str) -> None:
    with pytest.raises(SglangArgsError) as err:
        F.split_flags(argv)
    assert err.value.flag == flag


# ---- launch_router ---------------------------------------------------------------------


def test_router_pd_command_line_parses() -> None:
    args = F.parse_router_args(C.ROUTER_ARGV)
    assert args.pd_disaggregation is True
    assert (args.host, args.port, args.policy) == ("0.0.0.0", 8000, "round_robin")
    assert (args.prometheus_host, args.prometheus_port) == ("0.0.0.0", 29000)
    assert F.router_prefill_urls(args) == C.ROUTER_PREFILL_URLS
    assert [d[0] for d in args.decode] == C.ROUTER_DECODE_URLS
    for flag in ("--pd-disaggregation", "--prefill", "--decode", "--host", "--port"):
        assert F.router_flag(flag) is not None, flag
    assert [u.option for u in F.split_router_flags(C.ROUTER_ARGV)][:3] == [
        "--pd-disaggregation",
        "--prefill",
        "--prefill",
    ]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--pd-disaggregation", "--prefill", "http://p:1", "port"], "--prefill"),
        (["--pd-disaggregation", "--decode", "http://d:1", "http://d:2"], None),  # nargs=1
        (["--policy", "fastest"], "--policy"),
        (["--disaggregation-mode", "prefill"], "--disaggregation-mode"),  # a server flag
    ],
)
def test_bad_router_command_lines_are_refused(argv: list[str], flag: str | None) -> None:
    with pytest.raises(SglangArgsError) as err:
        F.parse_router_args(argv)
    if flag is not None:
        assert err.value.flag == flag


# ---- the generator's parser <-> JSON conversion -----------------------------------------


class _Shout(argparse.Action):
    """A custom action: stores the value upper-cased (the snapshot keeps its arity only)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, str(values).upper())


def small_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--ratio", type=float)
    parser.add_argument("--mode", choices={"null", "prefill", "decode"}, default="null")
    parser.add_argument("--level", type=int, choices=[3, 1, 2], default=1)
    parser.add_argument("--tokens", type=human_readable_int)
    parser.add_argument("--extra", type=json.loads)
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--no-flag-b", dest="flag_b", action="store_false")
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction)
    parser.add_argument("--urls", nargs="*", default=[])
    parser.add_argument("--prefill", nargs="+", action="append")
    parser.add_argument("--maybe", nargs="?", const="c", default="d")
    parser.add_argument("--shout", action=_Shout)
    parser.add_argument("--selector", default={})
    parser.add_argument("--opaque", type=lambda s: s, default=(1, 2))
    return parser


SMALL_ARGVS = [
    ["--model", "m"],
    ["--model-path=m", "--tp", "4", "--ratio", "0.5", "--mode", "decode", "--level", "3"],
    ["--model", "m", "--tokens", "2Mi", "--extra", '{"a": [1]}', "--flag", "--no-flag-b"],
    ["--model", "m", "--no-fused", "--urls", "--maybe", "--prefill", "u", "1", "--prefill", "v"],
    ["--model", "m", "--fused", "--urls", "a", "b", "--maybe", "x", "--opaque", "o"],
]


def test_snapshot_of_a_small_parser() -> None:
    doc = snapshot_parser(small_parser(), package="p", version="1")
    assert (doc["package"], doc["version"], doc["parser"]) == (
        "p",
        "1",
        {"allow_abbrev": True, "prefix_chars": "-"},
    )
    entry = {a["dest"]: a for a in doc["actions"]}
    assert entry["help"]["action"] == "help"
    assert entry["model_path"] | {} == {
        "option_strings": ["--model-path", "--model"],
        "dest": "model_path",
        "action": "store",
        "type": None,
        "nargs": None,
        "choices": None,
        "const": None,
        "required": True,
        "default": None,
    }
    assert entry["mode"]["choices"] == ["decode", "null", "prefill"]  # a set, sorted
    assert entry["level"]["choices"] == [1, 2, 3]
    assert [entry[d]["type"] for d in ("tp_size", "ratio", "tokens", "extra", "opaque")] == [
        "int",
        "float",
        "human_readable_int",
        "json",
        "<lambda>",
    ]
    assert entry["fused"]["option_strings"] == ["--fused", "--no-fused"]
    assert entry["fused"]["action"] == "boolean_optional"
    assert (entry["prefill"]["action"], entry["prefill"]["nargs"]) == ("append", "+")
    assert (entry["shout"]["action"], entry["shout"]["action_class"]) == ("custom", "_Shout")
    assert entry["selector"]["default"] == {}
    assert (entry["opaque"]["default"], entry["opaque"]["default_repr"]) == (None, "(1, 2)")
    json.dumps(doc, allow_nan=False)  # plain JSON throughout


@pytest.mark.parametrize("argv", SMALL_ARGVS)
def test_rebuilt_parser_parses_like_the_original(argv: list[str]) -> None:
    original = small_parser()
    rebuilt = build_parser(snapshot_parser(original), prog="small")
    want, got = vars(original.parse_args(argv)), vars(rebuilt.parse_args(argv))
    # Not reproduced (module doc): custom actions' effects, defaults without a JSON form.
    for dest in ("shout", "opaque"):
        want.pop(dest), got.pop(dest)
    assert got == want


def test_round_trip_is_stable() -> None:
    """parser -> JSON -> parser -> JSON gives the same JSON, except where the module doc
    says the rebuild differs: help/custom actions, unknown types, non-JSON defaults."""
    doc = snapshot_parser(small_parser())
    again = {a["dest"]: a for a in snapshot_parser(build_parser(doc, prog="small"))["actions"]}
    differ = {"help", "shout", "opaque"}
    assert [again[a["dest"]] for a in doc["actions"] if a["dest"] not in differ] == [
        a for a in doc["actions"] if a["dest"] not in differ
    ]
    assert (again["opaque"]["type"], again["opaque"]["default"]) == ("str", None)


def test_snapshot_refuses_what_json_cannot_hold() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--x", choices=[object()])
    with pytest.raises(ValueError, match="no JSON form"):
        snapshot_parser(parser)


def test_type_names() -> None:
    assert [type_name(t) for t in (None, str, int, float, json.loads)] == [
        None,
        "str",
        "int",
        "float",
        "json",
    ]
    assert type_name(human_readable_int) == "human_readable_int"


@pytest.mark.parametrize(
    ("text", "value"),
    [("7", 7), (" 7 ", 7), ("1k", 1000), ("25.6k", 25600), ("1M", 10**6), ("2G", 2 * 10**9),
     ("1T", 10**12), ("1Ki", 1024), ("3Mi", 3 * 2**20), ("1Gi", 2**30), ("1Ti", 2**40)],
)  # fmt: skip
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5Ki", "1K", "1m", "k", "1 k", "x"])
def test_human_readable_int_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)
