"""KVAllocator: paged full + SWA allocation, window eviction, PD tail preallocation, safety."""

from __future__ import annotations

import pytest
import torch
from mem_helpers import allocator_state, same_state, small_memory, t

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.errors import InvalidArgument, OutOfPages, OwnershipError, RequestTooLong
from dsv4_worker.mem.kv_allocator import KVAllocator

P = 16  # tiny's page; window 8


def _alloc(**overrides: int) -> KVAllocator:
    cfg = dict(
        page_size=P,
        num_full_pages=24,
        num_swa_pages=10,
        num_request_slots=4,
        max_pages_per_request=8,
        window_tokens=8,
        draft_tokens=0,
    )
    cfg.update(overrides)
    return KVAllocator(AllocatorConfig(**cfg))


def _opened(a: KVAllocator, *slots: int) -> torch.Tensor:
    s = t(*slots)
    a.open(s)
    return s


def _mapped_columns(a: KVAllocator, slot: int) -> list[bool]:
    _, swa = a.request_pages(slot)
    return (swa > 0).tolist()


def test_extend_returns_each_new_token_slot_through_the_page_table() -> None:
    a = _alloc()
    s = _opened(a, 1, 2)
    out = a.extend(s, t(20, 5)).tolist()
    assert len(out) == 25 == len(set(out))
    expected = [int(a.page_table[1, p // P]) * P + p % P for p in range(20)]
    expected += [int(a.page_table[2, 0]) * P + p for p in range(5)]
    assert out == expected
    assert a.num_tokens[1:3].tolist() == [20, 5]
    assert [u.used for u in a.usage()] == [3, 3]  # every new page got an SWA page
    more = a.extend(s, t(12, 0)).tolist()  # fills page 1 of request 1, then opens page 2
    assert more == [int(a.page_table[1, p // P]) * P + p % P for p in range(20, 32)]
    a.check_integrity()


def test_decode_allocates_a_page_only_at_a_page_boundary() -> None:
    a = _alloc()
    s = _opened(a, 1, 2)
    a.extend(s, t(16, 17))
    used = a.full.num_used
    out = a.decode(s).tolist()
    assert a.full.num_used == used + 1  # only request 1 (16 tokens) rolled over
    assert out == [int(a.page_table[1, 1]) * P, int(a.page_table[2, 1]) * P + 1]
    assert a.num_tokens[1:3].tolist() == [17, 18]
    a.check_integrity()


@pytest.mark.parametrize(("draft", "freed_at_70"), [(0, 3), (2, 3), (15, 2)])
def test_eviction_frees_exactly_the_out_of_window_pages(draft: int, freed_at_70: int) -> None:
    a = _alloc(draft_tokens=draft)
    s = _opened(a, 1)
    a.extend(s, t(70))  # 5 pages
    keep = 8 + draft
    assert a.evict_window() == freed_at_70 == (70 - keep) // P
    boundary = (70 - keep) // P
    assert _mapped_columns(a, 1) == [c >= boundary for c in range(5)]
    assert a.evict_window() == 0  # idempotent
    a.check_integrity()
    # Decode up to the point where the window leaves one more page, and not a token earlier.
    while int(a.num_tokens[1]) - keep < (boundary + 1) * P:
        assert a.evict_window(s) == 0
        a.decode(s)
    assert a.evict_window(s) == 1
    a.check_integrity()


def test_tail_preallocation_maps_exactly_the_page_floored_window_tail() -> None:
    a = _alloc()
    s = _opened(a, 3)
    a.alloc_tail(s, t(50))  # window floor = floor_to_page(42) = 32 -> columns 2, 3
    assert _mapped_columns(a, 3) == [False, False, True, True]
    assert [u.used for u in a.usage()] == [4, 2]
    assert int(a.swa_start_tokens[3]) == 32
    a.check_integrity()
    a.decode(s)
    a.free(s)
    assert [u.used for u in a.usage()] == [0, 0]
    a.check_integrity()


def test_tail_preallocation_clears_stale_mappings_of_recycled_pages() -> None:
    """The reference engine's #25805: recycled full pages kept a previous owner's SWA page."""
    a = _alloc()
    victim = _opened(a, 1)
    a.extend(victim, t(10))
    victim_swa = int(a.host.full_to_swa[a.host.page_table[1, 0]])
    # The pages the next 4-page allocation will take; pretend an earlier owner left mappings
    # (on the host and on the device).
    recycled = torch.from_numpy(a.full.free_units()[:4])
    a.host.full_to_swa[recycled[:2].numpy()] = victim_swa  # columns 0 and 1: outside the tail
    a.full_to_swa[recycled[:2]] = victim_swa
    s = _opened(a, 2)
    a.alloc_tail(s, t(50))
    assert torch.equal(a.page_table[2, :4], recycled)
    assert _mapped_columns(a, 2) == [False, False, True, True]
    a.check_integrity()
    a.free(s)
    assert int(a.swa.owner[victim_swa]) == int(a.page_table[1, 0])  # victim's page survived
    a.check_integrity()


def test_free_with_a_stale_mapping_raises_and_changes_nothing() -> None:
    a = _alloc()
    s1, s2 = _opened(a, 1), _opened(a, 2)
    a.extend(s1, t(40))
    a.extend(s2, t(3))
    a.evict_window()
    host = a.host  # the truth every check reads
    other_swa = int(host.full_to_swa[host.page_table[2, 0]])
    host.full_to_swa[host.page_table[1, 0]] = other_swa  # stale: an evicted column maps a live page
    before = allocator_state(a)
    with pytest.raises(OwnershipError):
        a.free(s1)
    with pytest.raises(OwnershipError):
        a.free(t(1, 2))
    assert same_state(before, allocator_state(a))


def test_double_free_and_closed_or_repeated_slots_raise_and_change_nothing() -> None:
    a = _alloc()
    s = _opened(a, 1, 2)
    a.extend(s, t(5, 5))
    a.free(s[:1])
    before = allocator_state(a)
    for op in (
        lambda: a.free(t(1)),
        lambda: a.decode(t(2, 1)),
        lambda: a.extend(t(2, 2), t(1, 1)),
        lambda: a.decode(t(2, 2)),
        lambda: a.evict_window(t(1)),
        lambda: a.open(t(2)),
        lambda: a.free(t(2, 2)),
    ):
        with pytest.raises(OwnershipError):
            op()
        assert same_state(before, allocator_state(a))


def test_failed_batch_allocations_change_nothing() -> None:
    a = _alloc(num_full_pages=6, num_swa_pages=4)
    s = _opened(a, 1, 2, 3)
    a.extend(s, t(16, 16, 1))  # 3 full + 3 SWA pages; 1 SWA page left
    before = allocator_state(a)
    cases: list[tuple[object, type[Exception], str | None]] = [
        (lambda: a.extend(s, t(16, 16, 0)), OutOfPages, "swa"),  # 2 pages, 1 SWA left
        (lambda: a.extend(s, t(40, 40, 0)), OutOfPages, "full"),
        (lambda: a.decode(s[:2]), OutOfPages, "swa"),  # two rollovers, one SWA page
        (lambda: a.extend(s, t(200, 0, 0)), RequestTooLong, None),
        (lambda: a.extend(s, t(1, -1, 0)), InvalidArgument, None),
    ]
    for op, exc, pool in cases:
        with pytest.raises(exc) as err:
            op()  # type: ignore[operator]
        if pool is not None:
            assert isinstance(err.value, OutOfPages) and err.value.pool == pool
        assert same_state(before, allocator_state(a))
    a.check_integrity()


def test_failed_tail_preallocation_changes_nothing() -> None:
    a = _alloc(num_full_pages=8, num_swa_pages=2)
    s = _opened(a, 1, 2)
    before = allocator_state(a)
    with pytest.raises(OutOfPages):
        a.alloc_tail(s, t(50, 50))  # 4 + 4 full pages fit, 2 + 2 tail SWA pages do not
    with pytest.raises(InvalidArgument):
        a.alloc_sparse(s, t(40, 40), t(16, 8))  # swa start not page-aligned
    with pytest.raises(InvalidArgument):
        a.alloc_sparse(s, t(50, 50), t(16, 48))  # an in-window page would get no SWA page
    with pytest.raises(RequestTooLong):
        a.alloc_tail(s, t(40, 200))
    assert same_state(before, allocator_state(a))
    a.alloc_tail(s[:1], t(40))
    with pytest.raises(OwnershipError):
        a.alloc_tail(s[:1], t(10))  # not fresh any more


def test_request_too_long_at_decode_and_table_end() -> None:
    a = _alloc(max_pages_per_request=2)
    s = _opened(a, 1)
    a.extend(s, t(32))
    before = allocator_state(a)
    with pytest.raises(RequestTooLong):
        a.decode(s)
    assert same_state(before, allocator_state(a))


def test_non_power_of_two_page_size() -> None:
    a = _alloc(page_size=12, window_tokens=5)
    s = _opened(a, 1, 2)
    out = a.extend(s, t(25, 12)).tolist()
    assert out[:25] == [int(a.page_table[1, p // 12]) * 12 + p % 12 for p in range(25)]
    assert a.decode(s).tolist() == [
        int(a.page_table[1, 2]) * 12 + 1,
        int(a.page_table[2, 1]) * 12,
    ]
    assert a.evict_window() == 1  # request 1: 26 tokens, keep 5 -> floor_to_page(21) = 12
    a.check_integrity()
    a.free(s)
    assert [u.used for u in a.usage()] == [0, 0]


def test_memory_open_free_round_trip_and_usage() -> None:
    mem = small_memory("hybrid-tiny")
    slots = mem.open(3)
    mem.pages.extend(slots, t(30, 1, 0))
    usage = {u.pool: (u.used, u.total) for u in mem.usage()}
    assert usage == {"full": (3, 24), "swa": (3, 10), "req_slots": (3, 5)}
    mem.check_integrity()
    mem.free(slots)
    assert all(u.used == 0 for u in mem.usage())
    mem.check_integrity()
