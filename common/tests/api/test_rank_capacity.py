"""RankCapacity, the one capacity quadruple: validated at construction, and its dict form (the
wire object of /status and the rank config) round-trips exactly through the document codec."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api import RankCapacity
from dsv4_common.api.documents import DocumentError, from_document, to_document
from dsv4_common.api.rank_config import PlannedRank
from dsv4_common.api.worker_status import WorkerStatus, build_worker_status, parse_worker_status
from dsv4_common.core.invariants import FieldError

KEYS = ("full_tokens", "swa_tokens", "max_running_requests", "max_context_tokens")
counts = st.integers(min_value=0, max_value=1 << 62)
capacities = st.builds(RankCapacity, counts, counts, counts, counts)


@given(capacities)
def test_dict_form_round_trips_through_json(capacity: RankCapacity) -> None:
    doc = json.loads(json.dumps(to_document(capacity)))
    assert tuple(doc) == KEYS  # the wire keys, in field order
    assert from_document(RankCapacity, doc, "capacity") == capacity


@given(
    st.dictionaries(st.sampled_from(KEYS), counts, min_size=4),
    st.dictionaries(st.text(min_size=1).filter(lambda k: k not in KEYS), counts, max_size=3),
)
def test_unknown_keys_are_ignored(doc: dict[str, int], extra: dict[str, int]) -> None:
    parsed = from_document(RankCapacity, {**doc, **extra}, "capacity")
    assert to_document(parsed) == {k: doc[k] for k in KEYS}


@pytest.mark.parametrize("key", KEYS)
@given(value=st.integers(max_value=-1))
def test_a_negative_count_is_refused_naming_its_field(key: str, value: int) -> None:
    good = dict.fromkeys(KEYS, 1)
    with pytest.raises(FieldError) as built:
        RankCapacity(**{**good, key: value})
    assert (built.value.field, built.value.reason) == (key, f"must be >= 0, got {value}")
    with pytest.raises(DocumentError, match=rf"^capacity\.{key}: must be >= 0, got {value}$"):
        from_document(RankCapacity, {**good, key: value}, "capacity")


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", [1.0, True, "1", None])
def test_a_count_that_is_not_an_integer_is_refused(key: str, value: Any) -> None:
    good: dict[str, Any] = dict.fromkeys(KEYS, 1)
    with pytest.raises(FieldError, match=rf"^{key}: must be an integer"):
        RankCapacity(**{**good, key: value})
    with pytest.raises(DocumentError, match=rf"^capacity\.{key}: must be "):
        from_document(RankCapacity, {**good, key: value}, "capacity")


def test_a_missing_count_is_named() -> None:
    with pytest.raises(DocumentError, match=r"^capacity\.swa_tokens: required$"):
        from_document(RankCapacity, dict.fromkeys(set(KEYS) - {"swa_tokens"}, 1), "capacity")


def test_the_quadruple_is_its_fields() -> None:
    assert tuple(f.name for f in fields(RankCapacity)) == KEYS
    assert RankCapacity(8, 4, 2, 8) == RankCapacity(
        full_tokens=8, swa_tokens=4, max_running_requests=2, max_context_tokens=8
    )


# ---- embedded: the wire forms that carry it are those of before it existed -----------------


@given(capacities)
def test_a_status_document_nests_it_under_capacity(capacity: RankCapacity) -> None:
    status = WorkerStatus(role="decode", pp_rank=1, capacity=capacity)
    doc = json.loads(json.dumps(build_worker_status(status)))
    assert doc["capacity"] == {k: getattr(capacity, k) for k in KEYS}
    assert parse_worker_status(doc) == status


@given(capacities)
def test_the_rank_configs_planned_rank_keeps_its_flat_keys(capacity: RankCapacity) -> None:
    planned = PlannedRank((0, 3), (6,), capacity, weight_bytes=7, kv_bytes=9)
    doc = json.loads(json.dumps(to_document(planned)))
    assert doc == {
        "layers": [0, 3],
        "draft_layers": [6],
        **{k: getattr(capacity, k) for k in KEYS},
        "weight_bytes": 7,
        "kv_bytes": 9,
    }
    assert from_document(PlannedRank, doc, "rank_config.planned") == planned


def test_a_bad_planned_count_names_its_flat_path() -> None:
    doc = to_document(PlannedRank((0, 3), (), RankCapacity(8, 4, 2, 8), 1, 1))
    with pytest.raises(DocumentError, match=r"^rank_config\.planned\.swa_tokens: must be >= 0"):
        from_document(PlannedRank, {**doc, "swa_tokens": -1}, "rank_config.planned")
    del doc["max_context_tokens"]
    with pytest.raises(DocumentError, match=r"^rank_config\.planned\.max_context_tokens: required"):
        from_document(PlannedRank, doc, "rank_config.planned")
