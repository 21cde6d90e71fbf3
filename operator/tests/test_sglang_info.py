"""SGLang's /server_info as the operator reads it: the realized pools, requests and context,
from a document shaped like SGLang 0.5.23's; a document without a field the operator reads is
refused naming that field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.sglang_stand_in import server_info_doc

from dsv4_operator.flavors.sglang.info import (
    ServerInfo,
    ServerInfoError,
    parse_server_info,
    parse_server_infos,
)


def test_reads_the_pools_the_requests_and_the_context() -> None:
    doc = server_info_doc(
        full_tokens=491_520, context_tokens=131_072, swa_tokens=49_152, requests_per_dp=256
    )
    assert parse_server_info(doc) == ServerInfo(
        full_tokens=491_520,
        context_tokens=131_072,
        swa_tokens=49_152,
        max_running_requests=256,
        version="0.5.23",
    )


@given(
    full=st.integers(0, 10**9),
    context=st.integers(1, 10**7),
)
def test_the_largest_request_is_bounded_by_the_pool_and_the_context(
    full: int, context: int
) -> None:
    info = parse_server_info(server_info_doc(full_tokens=full, context_tokens=context))
    assert info.max_context_tokens == min(full, context)


def test_data_parallel_schedulers_sum_requests_and_take_the_least_swa_pool() -> None:
    doc = server_info_doc(full_tokens=8192, context_tokens=4096, swa_tokens=2048, dp=2)
    doc["internal_states"][1]["memory_usage"]["token_capacity_swa"] = 1792
    info = parse_server_info(doc)
    assert (info.max_running_requests, info.swa_tokens) == (512, 1792)
    # A scheduler that does not say: the total is unknown, not undercounted.
    del doc["internal_states"][1]["effective_max_running_requests_per_dp"]
    assert parse_server_info(doc).max_running_requests is None


def test_figures_sglang_does_not_report_stay_unknown() -> None:
    doc = server_info_doc(
        full_tokens=8192, context_tokens=4096, swa_tokens=None, requests_per_dp=None
    )
    info = parse_server_info(doc)
    assert (info.swa_tokens, info.max_running_requests) == (None, None)
    del doc["internal_states"]
    assert parse_server_info(doc).full_tokens == 8192
    doc["internal_states"] = [{"memory_usage": None}]
    assert parse_server_info(doc).swa_tokens is None


def _without(doc: dict[str, Any], *path: str | int) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


def _with(doc: dict[str, Any], value: object, *path: str | int) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


GOOD = server_info_doc(full_tokens=8192, context_tokens=4096, swa_tokens=2048)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_without(GOOD, "max_total_num_tokens"), "max_total_num_tokens"),
        (_with(GOOD, "8192", "max_total_num_tokens"), "max_total_num_tokens"),
        (_with(GOOD, True, "max_total_num_tokens"), "max_total_num_tokens"),
        (_with(GOOD, -1, "max_total_num_tokens"), "max_total_num_tokens"),
        (_without(GOOD, "context_length"), "context_length"),
        (_with(GOOD, None, "context_length"), "context_length"),
        (_with(GOOD, {"0": {}}, "internal_states"), "internal_states"),
        (_with(GOOD, [1], "internal_states"), "internal_states"),
        (_with(GOOD, 3, "internal_states", 0, "memory_usage"), "internal_states[0].memory_usage"),
        (
            _with(GOOD, 2.5, "internal_states", 0, "memory_usage", "token_capacity_swa"),
            "internal_states[0].memory_usage.token_capacity_swa",
        ),
        (
            _with(GOOD, "many", "internal_states", 0, "effective_max_running_requests_per_dp"),
            "internal_states[0].effective_max_running_requests_per_dp",
        ),
    ],
)
def test_a_document_without_what_the_operator_reads_is_refused_naming_it(
    doc: dict[str, Any], field: str
) -> None:
    with pytest.raises(ServerInfoError) as err:
        parse_server_info(doc)
    assert str(err.value).startswith(f"{field}:")


def test_not_an_object_is_refused() -> None:
    with pytest.raises(ServerInfoError, match="expected a JSON object, got list"):
        parse_server_info([GOOD])


def test_parse_server_infos_keeps_the_good_and_says_why_of_the_others() -> None:
    parsed, refused = parse_server_infos({"a-0": GOOD, "b-0": _without(GOOD, "context_length")})
    assert set(parsed) == {"a-0"} and parsed["a-0"].full_tokens == 8192
    assert refused == {"b-0": "/server_info: context_length: expected a count, got None"}
