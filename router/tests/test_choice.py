"""The pure pair choice: properties over random instance tables (hypothesis), and the rules
one example at a time (eligibility, load order, the pending penalty, probes, membership)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_common.api import RankCapacity
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.rank_config import Instance
from dsv4_common.api.worker_status import Load, WorkerStatus
from dsv4_router.choice import (
    InstanceRecord,
    InstanceTable,
    Probe,
    address_key,
    apply_probe,
    assess,
    choose,
    choose_pair,
    eligible,
    host_port,
    unavailable_reason,
)
from dsv4_router.liveness import Liveness, LivenessRule

NOW_S = 100.0
RULE = LivenessRule(misses=3, grace_s=3.0)
# No per-example deadline: the tests must not flake on a loaded machine.
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def status(
    role: WorkerRole, *, kv_ready: bool = True, load: Load | None = None, slots: int = 16
) -> WorkerStatus:
    return WorkerStatus(
        role=role,
        pp_rank=0,
        capacity=RankCapacity(
            full_tokens=8192, swa_tokens=1024, max_running_requests=slots, max_context_tokens=4096
        ),
        kv_ready=kv_ready,
        load=load or Load(4000, 500, 8, 0, 0, True),
    )


def record(
    role: WorkerRole,
    host: str = "10.0.0.1",
    *,
    age_s: float = 0.0,
    misses: int = 0,
    **status_kw: object,
) -> InstanceRecord:
    rec = InstanceRecord(role, Instance(host, 8080, 8081, 8083))
    rec.status = status(role, **status_kw)  # type: ignore[arg-type]
    rec.liveness = Liveness(ok_at_s=NOW_S - age_s, misses=misses)
    rec.ready = True
    return rec


@st.composite
def records(draw: st.DrawFn) -> InstanceRecord:
    role = draw(st.sampled_from(WORKER_ROLES))
    host = f"10.0.0.{draw(st.integers(1, 4))}"
    instance = Instance(host, draw(st.integers(1, 3)), 8081, draw(st.integers(1, 2)))
    rec = InstanceRecord(role, instance, ready=draw(st.booleans()))
    if draw(st.integers(0, 5)) > 0:  # mostly with a status
        load = Load(
            free_full_tokens=draw(st.integers(0, 10_000)),
            free_swa_tokens=draw(st.integers(0, 2_000)),
            free_request_slots=draw(st.integers(0, 16)),
            running=draw(st.integers(0, 16)),
            waiting=draw(st.integers(0, 8)),
            accepting=draw(st.integers(0, 4)) > 0,
        )
        reported: WorkerRole = role if draw(st.integers(0, 9)) > 0 else "decode"
        rec.status = status(
            reported,
            kv_ready=draw(st.integers(0, 4)) > 0,
            load=load,
            slots=draw(st.integers(0, 32)),
        )
        rec.liveness = Liveness(
            ok_at_s=NOW_S - draw(st.floats(0, 2 * RULE.grace_s)),
            misses=draw(st.integers(0, 2 * RULE.misses)),
            refused=draw(st.integers(0, 9)) == 0,
        )
    rec.status_sent_total = draw(st.integers(0, 3))
    rec.sent_total = rec.status_sent_total + draw(st.integers(0, 4))
    return rec


tables = st.lists(records(), max_size=10, unique_by=lambda r: (r.role, r.instance))


@st.composite
def tables_and_exclusions(draw: st.DrawFn) -> tuple[list[InstanceRecord], frozenset[Instance]]:
    table = draw(tables)
    excluded = draw(st.sets(st.sampled_from([r.instance for r in table]))) if table else set()
    return table, frozenset(excluded)


def is_eligible(rec: InstanceRecord) -> bool:
    return assess(rec, NOW_S, RULE)[0] == "eligible"


@PROPERTY
@given(tables_and_exclusions())
def test_the_pair_is_eligible_and_not_excluded(
    case: tuple[list[InstanceRecord], frozenset[Instance]],
) -> None:
    table, excluded = case
    pair = choose_pair(table, NOW_S, RULE, excluded)
    usable = {
        role: [r for r in table if r.role == role and is_eligible(r) and r.instance not in excluded]
        for role in WORKER_ROLES
    }
    if pair is None:
        assert not usable["prefill"] or not usable["decode"]
        assert unavailable_reason(table, NOW_S, RULE, excluded) != ""
        return
    assert (pair.prefill.role, pair.decode.role) == ("prefill", "decode")
    assert is_eligible(pair.prefill) and is_eligible(pair.decode)
    assert pair.prefill.instance not in excluded and pair.decode.instance not in excluded
    assert unavailable_reason(table, NOW_S, RULE, excluded) == ""


@PROPERTY
@given(tables_and_exclusions())
def test_the_pair_is_the_least_loaded(
    case: tuple[list[InstanceRecord], frozenset[Instance]],
) -> None:
    table, excluded = case
    pair = choose_pair(table, NOW_S, RULE, excluded)
    if pair is None:
        return

    def queued(r: InstanceRecord) -> int:
        assert r.status is not None
        return r.status.load.waiting + r.pending

    def decode_order(r: InstanceRecord) -> tuple[int, float]:
        """Fewest queued, then the most headroom in the pool that binds (issue #41 item 4)."""
        assert r.status is not None
        cap, load = r.status.capacity, r.status.load
        slots = max(1, cap.max_running_requests)
        queued = load.waiting + max(0, r.pending - load.free_request_slots)
        free = [(load.free_request_slots - r.pending) / slots]
        if cap.full_tokens:
            free.append(
                (load.free_full_tokens - r.pending * cap.full_tokens / slots) / cap.full_tokens
            )
        if cap.swa_tokens:
            free.append(
                (load.free_swa_tokens - r.pending * cap.swa_tokens / slots) / cap.swa_tokens
            )
        return (queued, -min(free))

    assert pair.prefill.status is not None
    for other in eligible(table, "prefill", NOW_S, RULE, excluded):
        assert other.status is not None
        assert queued(pair.prefill) <= queued(other)
        if queued(other) == queued(pair.prefill):
            assert pair.prefill.status.load.free_full_tokens >= other.status.load.free_full_tokens
    for other in eligible(table, "decode", NOW_S, RULE, excluded):
        assert decode_order(pair.decode) <= decode_order(other)


@PROPERTY
@given(tables_and_exclusions())
def test_the_pair_is_what_choose_picks_for_each_role(
    case: tuple[list[InstanceRecord], frozenset[Instance]],
) -> None:
    """choose_pair (one pass, on every request) picks exactly what `choose` does per role."""
    table, excluded = case
    pair = choose_pair(table, NOW_S, RULE, excluded)
    prefill = choose(table, "prefill", NOW_S, RULE, excluded)
    decode = choose(table, "decode", NOW_S, RULE, excluded)
    if prefill is None or decode is None:
        assert pair is None
    else:
        assert pair is not None
        assert pair.prefill is prefill and pair.decode is decode


@PROPERTY
@given(tables_and_exclusions(), st.randoms(use_true_random=False))
def test_the_choice_does_not_depend_on_order(
    case: tuple[list[InstanceRecord], frozenset[Instance]], rng: random.Random
) -> None:
    table, excluded = case
    shuffled = list(table)
    rng.shuffle(shuffled)
    first = choose_pair(table, NOW_S, RULE, excluded)
    second = choose_pair(shuffled, NOW_S, RULE, excluded)
    if first is None or second is None:
        assert first is second
    else:
        assert (first.prefill.instance, first.decode.instance) == (
            second.prefill.instance,
            second.decode.instance,
        )


class TestEligibility:
    def test_fresh_ready_accepting_is_eligible(self) -> None:
        assert assess(record("decode"), NOW_S, RULE) == ("eligible", "")

    def test_an_old_status_alone_is_not_stale(self) -> None:
        """The issue's spurious 503: a status 3.3 s old while every probe since was fine."""
        assert assess(record("decode", age_s=RULE.grace_s + 0.3), NOW_S, RULE)[0] == "eligible"

    def test_an_old_status_after_missed_probes_is_stale(self) -> None:
        rec = record("decode", age_s=RULE.grace_s, misses=RULE.misses)
        health, why = assess(rec, NOW_S, RULE)
        assert health == "stale" and "3 probes in a row failed" in why

    def test_no_status_is_stale_with_the_error(self) -> None:
        rec = InstanceRecord("prefill", Instance("h", 1, 2, 3), error="/status answered 500")
        assert assess(rec, NOW_S, RULE) == ("stale", "no status yet (/status answered 500)")

    def test_not_ready_is_unready(self) -> None:
        rec = record("prefill")
        rec.ready = False
        assert assess(rec, NOW_S, RULE)[0] == "unready"

    def test_kv_ready_matters_for_decode_only(self) -> None:
        assert assess(record("decode", kv_ready=False), NOW_S, RULE)[0] == "unready"
        assert assess(record("prefill", kv_ready=False), NOW_S, RULE)[0] == "eligible"

    def test_not_accepting_is_busy(self) -> None:
        rec = record("decode", load=Load(4000, 500, 8, 0, 0, accepting=False))
        assert assess(rec, NOW_S, RULE)[0] == "busy"
        assert unavailable_reason([record("prefill"), rec], NOW_S, RULE) == (
            "every ready decode instance is busy"
        )

    def test_a_wrong_role_is_unready(self) -> None:
        rec = record("prefill")
        rec.status = status("decode")
        assert assess(rec, NOW_S, RULE) == ("unready", "reports role 'decode'")


class TestLoadOrder:
    def test_prefill_fewest_queued_then_most_free(self) -> None:
        a = record("prefill", "10.0.0.1", load=Load(9000, 0, 8, 0, 1, True))
        b = record("prefill", "10.0.0.2", load=Load(1000, 0, 8, 0, 0, True))
        c = record("prefill", "10.0.0.3", load=Load(2000, 0, 8, 0, 0, True))
        assert choose([a, b, c], "prefill", NOW_S, RULE) is c
        c.sent()  # the router's own request counts until the next status
        assert choose([a, b, c], "prefill", NOW_S, RULE) is b

    def test_decode_pending_requests_cost_a_share_each(self) -> None:
        # share = 8192 full tokens / 16 slots = 512 tokens per pending request; the full pool
        # binds (SWA 1000/1024 free, 8/16 slots free)
        a = record("decode", "10.0.0.1", load=Load(5000, 1000, 16, 0, 0, True))
        b = record("decode", "10.0.0.2", load=Load(4800, 1000, 16, 0, 0, True))
        assert choose([a, b], "decode", NOW_S, RULE) is a
        a.sent()
        assert choose([a, b], "decode", NOW_S, RULE) is b

    # (A's load, B's load, which is chosen, why): capacity 8192 full, 1024 SWA, 16 slots.
    DECODE_TABLE = (
        (Load(8000, 60, 12, 4, 0, True), Load(3000, 600, 12, 4, 0, True), "B", "A's SWA binds"),
        (Load(8000, 1000, 0, 16, 0, True), Load(2000, 900, 4, 12, 0, True), "B", "A's slots bind"),
        (Load(8000, 1000, 16, 0, 2, True), Load(1000, 200, 2, 14, 0, True), "B", "A has a queue"),
        (Load(6000, 800, 10, 6, 0, True), Load(5000, 500, 10, 6, 0, True), "A", "both roomy"),
    )

    def test_decode_choice_weighs_every_pool_and_the_queue(self) -> None:
        for load_a, load_b, chosen, why in self.DECODE_TABLE:
            a = record("decode", "10.0.0.1", load=load_a)
            b = record("decode", "10.0.0.2", load=load_b)
            got = choose([a, b], "decode", NOW_S, RULE)
            assert got is (a if chosen == "A" else b), why

    def test_pending_requests_past_the_free_slots_count_as_queued(self) -> None:
        a = record("decode", "10.0.0.1", load=Load(8000, 1000, 1, 15, 0, True))
        b = record("decode", "10.0.0.2", load=Load(1000, 100, 2, 14, 0, True))
        assert choose([a, b], "decode", NOW_S, RULE) is b  # a's one free slot binds first
        b.sent()
        b.sent()
        b.sent()  # three pending on two free slots: one queued
        assert choose([a, b], "decode", NOW_S, RULE) is a

    def test_decode_ties_by_running_then_address(self) -> None:
        a = record("decode", "10.0.0.2", load=Load(5000, 0, 8, 3, 0, True))
        b = record("decode", "10.0.0.3", load=Load(5000, 0, 8, 1, 0, True))
        c = record("decode", "10.0.0.1", load=Load(5000, 0, 8, 3, 0, True))
        assert choose([a, b, c], "decode", NOW_S, RULE) is b
        assert choose([a, c], "decode", NOW_S, RULE) is c

    def test_excluded_instances_are_skipped(self) -> None:
        p = record("prefill", "10.0.0.9")
        a = record("decode", "10.0.0.1", load=Load(9000, 0, 8, 0, 0, True))
        b = record("decode", "10.0.0.2")
        pair = choose_pair([p, a, b], NOW_S, RULE, frozenset({a.instance}))
        assert pair is not None and pair.decode is b
        assert choose_pair([p, a, b], NOW_S, RULE, frozenset({p.instance})) is None
        assert unavailable_reason([p, a, b], NOW_S, RULE, frozenset({p.instance})) == (
            "every ready prefill instance failed this request"
        )


class TestProbes:
    def test_a_status_resets_pending_to_requests_sent_after_the_poll_began(self) -> None:
        rec = InstanceRecord("decode", Instance("h", 1, 2, 3))
        rec.sent()
        at_start = rec.sent_total
        rec.sent()  # sent while the poll was in flight: the status cannot include it
        apply_probe(rec, Probe(status("decode"), True, None, at_start), NOW_S)
        assert rec.pending == 1
        assert rec.status_at_s == NOW_S and rec.ready and rec.error is None

    def test_misses_keep_the_status_until_the_rule_makes_it_stale(self) -> None:
        rec = InstanceRecord("decode", Instance("h", 1, 2, 3))
        apply_probe(rec, Probe(status("decode"), True, None, 0), NOW_S)
        apply_probe(rec, Probe(None, None, None, 0), NOW_S + 1)  # both probes timed out
        assert (rec.status, rec.status_at_s, rec.ready) == (status("decode"), NOW_S, True)
        assert rec.error == "status probe timed out"
        apply_probe(rec, Probe(None, None, "/status answered 503", 0), NOW_S + 2)
        assert rec.status == status("decode") and rec.liveness.misses == 2
        assert assess(rec, NOW_S + 5, RULE)[0] == "eligible"  # two misses: not yet
        apply_probe(rec, Probe(None, False, "/status answered 503", 0), NOW_S + 3)
        assert not rec.ready and assess(rec, NOW_S + 3, RULE) == (
            "stale",
            "3 probes in a row failed, no status for 3.0 s (/status answered 503)",
        )
        apply_probe(rec, Probe(status("decode"), True, None, 0), NOW_S + 4)
        assert assess(rec, NOW_S + 4, RULE) == ("eligible", "")

    def test_a_refused_connection_is_stale_at_once(self) -> None:
        """Nothing listens: the process is gone (a stopped one still accepts connections)."""
        rec = record("prefill")
        apply_probe(rec, Probe(None, False, "/status: refused", 0, refused=True), NOW_S)
        health, why = assess(rec, NOW_S, RULE)
        assert health == "stale" and why.startswith("nothing listens")

    def test_done_balances_sent(self) -> None:
        rec = InstanceRecord("prefill", Instance("h", 1, 2, 3))
        rec.sent()
        rec.done()
        assert (rec.inflight, rec.sent_total) == (0, 1)


def test_table_sync_keeps_history_and_drops_the_gone() -> None:
    table = InstanceTable()
    a, b = Instance("10.0.0.2", 1, 2, 3), Instance("10.0.0.1", 1, 2, 3)
    table.sync("decode", [a, b])
    table.sync("prefill", [a])
    [first] = [r for r in table.records() if r.role == "decode" and r.instance == a]
    first.sent()
    table.sync("decode", [a])
    assert [(r.role, r.instance) for r in table.records()] == [("decode", a), ("prefill", a)]
    assert table.records()[0] is first and first.sent_total == 1
    assert address_key(b) < address_key(a)


@PROPERTY
@given(
    st.lists(
        st.tuples(
            st.sampled_from(WORKER_ROLES),
            st.sets(
                st.builds(
                    Instance,
                    st.sampled_from(["10.0.0.1", "10.0.0.2"]),
                    st.integers(1, 3),
                    st.just(2),
                    st.just(3),
                )
            ),
        ),
        max_size=6,
    )
)
def test_records_follow_every_sync(syncs: list[tuple[WorkerRole, set[Instance]]]) -> None:
    """records() (kept between syncs) is always each role's last sync, sorted by role then
    address; a caller changing the list it got changes nothing."""
    table = InstanceTable()
    last: dict[WorkerRole, set[Instance]] = {}
    for role, instances in syncs:
        table.records().clear()
        table.sync(role, instances)
        last[role] = instances
        expected = sorted((r, address_key(i)) for r, group in last.items() for i in group)
        assert [(r.role, address_key(r.instance)) for r in table.records()] == expected


def test_host_port_brackets_ipv6() -> None:
    assert host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert host_port("fd00::1", 80) == "[fd00::1]:80"
