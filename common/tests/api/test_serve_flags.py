"""The `dsv4 serve` flag table: one row per flag; the operator's owned flags, the parser and
`--help` all follow from it."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_cli.flags import bounded
from dsv4_cli.main import build_parser
from dsv4_common.api.serve_flags import (
    FRACTION,
    PORT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SERVE_FLAGS,
    SIZING_FLAGS,
    Bounds,
    operator_owned,
    serve_flag,
)

# What `podtemplate.OWNED_FLAGS` held when it was written out by hand: the table must give the
# operator exactly these flags, each with where to set it instead (and the API key's and the PD
# secret's, added since: the operator mounts the key of spec.apiKey and the deployment's PD
# Secret).
OWNED_BEFORE_THE_TABLE = {
    "--role": "the pod's role",
    "--config-dir": "the mounted config",
    "--host": "the pod's address",
    "--port": "the worker's ports",
    "--kv-port": "the worker's ports",
    "--model": "spec.model",
    "--weights": "spec.model.weights",
    "--transfer": "spec.kv.transfer",
    "--page-size": "spec.kv.pageSize",
    "--request-state": "the rank config",
    "--max-running-requests": "spec.<role>.maxRunningRequests",
    "--chunked-prefill-size": "spec.<role>.chunkedPrefillTokens",
    "--context-len": "spec.maxContextTokens",
    "--gpu-memory-gib": "spec.gpu",
    "--pp-size": "spec.<role>.pipelineParallel",
    "--pp-rank": "the pod's PP rank",
    "--pp-addr": "the group's Service",
    "--prefill": "the router config",
    "--instance": "the router config",
    "--api-key": "spec.apiKey",
    "--api-key-file": "spec.apiKey",
    "--open-status": "spec.apiKey (a deployed status port is open, its API port wants the key)",
    "--pd-secret-file": "the deployment's PD Secret",
}
# Owned since: the compute dtype (#38).
OWNED_SINCE = {"--dtype": "spec.model.dtype"}


def test_the_operator_owns_what_it_owned_before() -> None:
    assert operator_owned() == OWNED_BEFORE_THE_TABLE | OWNED_SINCE


def test_the_operator_refuses_exactly_the_table_s_owned_flags() -> None:
    from dsv4_operator.podtemplate import OWNED_FLAGS

    assert operator_owned() == OWNED_FLAGS


def test_rows_are_unique_and_named_as_flags() -> None:
    names = [f.name for f in SERVE_FLAGS]
    assert len(set(names)) == len(names)
    assert all(n.startswith("--") and n == n.lower() for n in names)
    assert len({f.dest for f in SERVE_FLAGS}) == len(names)
    assert all(f in SERVE_FLAGS for f in SIZING_FLAGS)  # `plan` and `serve` share them
    assert serve_flag("--pp-addr").dest == "pp_addr"
    with pytest.raises(KeyError):
        serve_flag("--nope")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_the_serve_parser_is_the_table() -> None:
    actions = _options(_serve_parser())
    assert set(actions) - {"--help"} == {f.name for f in SERVE_FLAGS}
    for flag in SERVE_FLAGS:
        action = actions[flag.name]
        assert action.dest == flag.dest
        assert action.choices == flag.choices
        expected = list(flag.default) if flag.many == "repeat" else flag.default  # type: ignore[call-overload]
        assert action.default == expected, flag.name


def test_the_plan_parser_takes_the_sizing_rows() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = _options(sub.choices["plan"])
    for flag in SIZING_FLAGS:
        assert actions[flag.name].default == flag.default
        assert actions[flag.name].choices == flag.choices


def test_a_repeated_flag_starts_empty_on_every_parse() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--instance", "a", "--instance", "b"]).instance == ["a", "b"]
    assert parser.parse_args(["serve"]).instance == []


@pytest.mark.parametrize(
    ("bounds", "text", "error"),
    [
        (POSITIVE_INT, "0", "must be >= 1, got 0"),
        (POSITIVE_INT, "1.5", "expected an integer, got '1.5'"),
        (POSITIVE_FLOAT, "0", "must be > 0, got 0"),
        (POSITIVE_FLOAT, "inf", "expected a finite number, got 'inf'"),
        (FRACTION, "1.01", "must be <= 1, got 1.01"),
        (PORT, "65536", "must be <= 65535, got 65536"),
    ],
)
def test_a_value_out_of_bounds_names_the_bound(bounds: Bounds, text: str, error: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=error):
        bounded(bounds)(text)


@given(st.integers(min_value=0, max_value=65535))
def test_every_port_parses_to_itself(port: int) -> None:
    assert bounded(PORT)(str(port)) == port


@given(st.floats(min_value=1e-9, max_value=1.0))
def test_every_fraction_in_range_parses(value: float) -> None:
    assert bounded(FRACTION)(repr(value)) == value
