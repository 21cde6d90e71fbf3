"""PageAllocator and ReqSlotAllocator: ownership, double free, all-or-nothing, integrity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import small_memory, t

from dsv4_worker.mem.errors import IntegrityError, OutOfPages, OwnershipError
from dsv4_worker.mem.page_allocator import PageAllocator


def _state(a: PageAllocator) -> tuple[list[int], list[int]]:
    return a.owner.tolist(), a.free_units().tolist()


def test_alloc_hands_out_distinct_nonzero_pages_and_records_owners() -> None:
    a = PageAllocator("full", 6)
    pages = a.alloc(t(3, 3, 5))
    assert len(set(pages.tolist())) == 3 and 0 not in pages.tolist()
    assert a.owner[pages].tolist() == [3, 3, 5]
    assert (a.num_used, a.num_free) == (3, 3)
    a.check_integrity()


def test_out_of_pages_changes_nothing() -> None:
    a = PageAllocator("swa", 4)
    a.alloc(t(1, 1, 1))
    before = _state(a)
    with pytest.raises(OutOfPages) as err:
        a.alloc(t(2, 2))
    assert (err.value.pool, err.value.needed, err.value.available) == ("swa", 2, 1)
    assert _state(a) == before


@pytest.mark.parametrize(
    ("pages", "owners"),
    [
        ([1], [9]),  # not the owner
        ([1, 1], [7, 7]),  # the same page twice in one free
        ([3], [7]),  # a free page (double free)
        ([0], [7]),  # the reserved page
        ([5], [7]),  # out of range
        ([1], [0]),  # owner 0 means "free"
    ],
)
def test_bad_free_raises_and_changes_nothing(pages: list[int], owners: list[int]) -> None:
    a = PageAllocator("full", 4)
    got = a.alloc(t(7, 7))
    assert sorted(got.tolist()) == [1, 2]
    before = _state(a)
    with pytest.raises(OwnershipError):
        a.free(torch.tensor(pages), torch.tensor(owners))
    assert _state(a) == before
    a.check_integrity()


def test_free_then_double_free() -> None:
    a = PageAllocator("full", 4)
    pages = a.alloc(t(2, 2))
    a.free(pages, t(2, 2))
    assert a.num_free == 4
    with pytest.raises(OwnershipError):
        a.free(pages, t(2, 2))
    a.check_integrity()


def test_integrity_detects_a_corrupted_free_list() -> None:
    a = PageAllocator("full", 4)
    a.alloc(t(1))
    free = a._free[a.num_used :]  # the free list itself
    free[0] = free[1]  # a page on the free list twice
    with pytest.raises(IntegrityError, match="twice"):
        a.check_integrity()


def test_a_fresh_allocator_hands_out_ascending_runs() -> None:
    a = PageAllocator("full", 10)
    assert a.alloc(t(7, 7, 7)).tolist() == [1, 2, 3]
    assert a.alloc(t(8, 8)).tolist() == [4, 5]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pages_freed_together_come_back_as_the_same_run(data: st.DataObject) -> None:
    """Whatever came before, the pages of a free are the next allocation's pages, in the
    order they were freed: a request's ascending run stays one run for the next request (PD
    transfers merge such runs into one block per layer)."""
    num_pages = data.draw(st.integers(1, 40), label="num_pages")
    a = PageAllocator("full", num_pages)
    held: list[list[int]] = []
    for _ in range(data.draw(st.integers(0, 12), label="ops")):
        if held and data.draw(st.booleans(), label="free"):
            run = held.pop(data.draw(st.integers(0, len(held) - 1), label="which"))
            a.free(torch.tensor(run), torch.full((len(run),), 3))
        elif a.num_free:
            n = data.draw(st.integers(1, a.num_free), label="n")
            held.append(a.alloc(torch.full((n,), 3)).tolist())
    a.check_integrity()
    if not held:
        return
    run = held[data.draw(st.integers(0, len(held) - 1), label="freed")]
    a.free(torch.tensor(run), torch.full((len(run),), 3))
    assert a.alloc(torch.full((len(run),), 5)).tolist() == run
    a.check_integrity()


def test_request_slot_reuse_clears_request_scoped_state() -> None:
    mem = small_memory("tiny", slots=2)
    assert mem.pool is not None
    slots = mem.req_slots.alloc(2)
    for name in ("c16_state", "swa_kv", "c4_kv"):
        mem.pool.unit_bytes_view(name).fill_(7)
    mem.req_slots.free(slots[:1])
    again = mem.req_slots.alloc(1)
    assert again.tolist() == slots[:1].tolist()
    state = mem.pool.unit_bytes_view("c16_state")
    assert int(state[:, int(again[0])].count_nonzero()) == 0
    assert bool((state[:, int(slots[1])] == 7).all())  # the other request's state is untouched
    assert bool((mem.pool.unit_bytes_view("swa_kv") == 7).all())  # pages are not request state


def test_request_slots_double_free_and_exhaustion() -> None:
    mem = small_memory("hybrid-tiny", slots=2)
    slots = mem.req_slots.alloc(2)
    with pytest.raises(OutOfPages) as err:
        mem.req_slots.alloc(1)
    assert err.value.pool == "req_slots"
    mem.req_slots.free(slots)
    with pytest.raises(OwnershipError):
        mem.req_slots.free(slots[:1])
    mem.req_slots.check_integrity()
