"""The router's shed decision (pure): an instance whose queue is full (as it reports, or as the
router's own open requests count it) is busy and never chosen; when no pair is left the reason
label says why, and a decode that shed the request itself is `upstream_shed`."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from test_choice import NOW_S, PROPERTY, RULE, record, tables_and_exclusions

from dsv4_common.api.rank_config import Instance
from dsv4_common.api.worker_status import Load
from dsv4_router.choice import (
    SHED_REASONS,
    InstanceRecord,
    assess,
    choose_pair,
    queue_full,
    unavailable,
)
from dsv4_router.proxy import Failure, shed_reason


@st.composite
def queued_records(draw: st.DrawFn) -> InstanceRecord:
    slots = draw(st.integers(1, 16))
    load = Load(
        free_full_tokens=4000,
        free_swa_tokens=500,
        free_request_slots=draw(st.integers(0, slots)),
        running=draw(st.integers(0, slots)),
        waiting=draw(st.integers(0, 40)),
        accepting=True,
        max_queue_requests=draw(st.integers(0, 32)),
    )
    rec = record(draw(st.sampled_from(("prefill", "decode"))), load=load, slots=slots)
    for _ in range(draw(st.integers(0, 60))):
        rec.sent()
    return rec


@PROPERTY
@given(queued_records())
def test_a_full_queue_is_busy(rec: InstanceRecord) -> None:
    assert rec.status is not None
    load, slots = rec.status.load, rec.status.capacity.max_running_requests
    full = load.max_queue_requests > 0 and (
        max(load.waiting, rec.inflight - slots) >= load.max_queue_requests
    )
    assert queue_full(rec) == full
    health, why = assess(rec, NOW_S, RULE)
    assert (health == "busy") == full
    if full:
        assert why == "its queue is full"


@PROPERTY
@given(st.lists(queued_records(), max_size=6))
def test_a_full_instance_is_never_chosen(table: list[InstanceRecord]) -> None:
    for i, rec in enumerate(table):  # distinct addresses
        rec.instance = Instance(f"10.0.0.{i + 1}", 8080, 8081, 8083)
    pair = choose_pair(table, NOW_S, RULE)
    if pair is not None:
        assert not queue_full(pair.prefill) and not queue_full(pair.decode)
        return
    label, message = unavailable(table, NOW_S, RULE)
    assert label in SHED_REASONS and message
    for role in ("prefill", "decode"):
        of_role = [r for r in table if r.role == role]
        if of_role and all(queue_full(r) for r in of_role):
            assert label in ("busy", "unavailable")


@PROPERTY
@given(tables_and_exclusions())
def test_no_pair_always_has_a_reason_label(
    case: tuple[list[InstanceRecord], frozenset[Instance]],
) -> None:
    table, excluded = case
    label, message = unavailable(table, NOW_S, RULE, excluded)
    assert label in SHED_REASONS
    assert (message == "") == (choose_pair(table, NOW_S, RULE, excluded) is not None)


def test_every_busy_decode_sheds_as_busy() -> None:
    full = record("decode", load=Load(4000, 500, 0, 16, 32, True, max_queue_requests=32))
    assert unavailable([record("prefill"), full], NOW_S, RULE) == (
        "busy",
        "every ready decode instance is busy",
    )


def test_the_routers_own_open_requests_fill_the_queue_before_a_status_says_so() -> None:
    rec = record("decode", load=Load(4000, 500, 16, 0, 0, True, max_queue_requests=8), slots=16)
    for _ in range(16 + 7):
        rec.sent()
    assert assess(rec, NOW_S, RULE)[0] == "eligible"
    rec.sent()  # 16 running + 8 queued
    assert assess(rec, NOW_S, RULE) == ("busy", "its queue is full")
    rec.done()
    assert assess(rec, NOW_S, RULE)[0] == "eligible"


def test_a_worker_that_reports_no_bound_is_never_full() -> None:
    rec = record("decode", load=Load(4000, 500, 0, 16, 1000, True), slots=16)
    for _ in range(1000):
        rec.sent()
    assert not queue_full(rec)


def test_a_503_from_the_last_decode_is_upstream_shed() -> None:
    shed = Failure(503, "decode: 503: too many requests waiting", ())
    lost = Failure(None, "decode: no response within 5 s", ())
    assert shed_reason([shed], "failed") == "upstream_shed"
    assert shed_reason([shed, lost], "failed") == "failed"
    assert shed_reason([], "busy") == "busy"
