"""The free paths: `PageAllocator.check_free` refuses exactly a page listed twice or by another
owner, changing nothing; one request's free and a batch free leave the same state; a free
reads only host state, so it runs no torch operator where the device tables are the host's
and only the device writes where they are not (issue #26 item 2, issue #38 item 5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import allocator_state, emulating_device, same_state, t
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.errors import OwnershipError
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.page_allocator import PageAllocator

NUM_PAGES = 12


def _pool(owners: list[int]) -> PageAllocator:
    pool = PageAllocator("full", NUM_PAGES)
    pool.alloc(np.array(owners, dtype=np.int64))
    return pool


def _state(pool: PageAllocator) -> tuple[list[int], list[int]]:
    return pool.owner.tolist(), pool.free_units().tolist()


def _valid(pool: PageAllocator, pages: list[int], owners: list[int]) -> bool:
    """The rule: each page listed once, by its owner."""
    held = pool.owner.tolist()
    return len(set(pages)) == len(pages) and all(
        held[p] == o for p, o in zip(pages, owners, strict=True)
    )


@st.composite
def _frees(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Pool owners, then pages to free with their claimed owners: mostly the real owners,
    some repeated, some wrong, including k * owner for a page listed k times (the case a sum
    of owners would let through)."""
    owners = draw(st.lists(st.integers(1, 6), min_size=1, max_size=NUM_PAGES))
    pool_pages = list(range(1, len(owners) + 1))  # a fresh pool hands out 1, 2, ... in order
    pages = draw(st.lists(st.sampled_from(pool_pages), max_size=8))
    claimed = []
    for page in pages:
        real = owners[page - 1]
        claimed.append(draw(st.sampled_from([real, real, real + 1, pages.count(page) * real])))
    return owners, pages, claimed


@settings(max_examples=300, deadline=None)
@given(_frees())
def test_free_refuses_exactly_a_repeated_or_foreign_page_and_changes_nothing(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    owners, pages, claimed = case
    pool = _pool(owners)
    before = _state(pool)
    pages_h, claimed_h = np.array(pages, dtype=np.int64), np.array(claimed, dtype=np.int64)
    if not _valid(pool, pages, claimed):
        for op in (pool.check_owned, pool.free):
            with pytest.raises(OwnershipError):
                op(pages_h, claimed_h)
            assert _state(pool) == before
        return
    pool.check_owned(pages_h, claimed_h)
    assert _state(pool) == before
    pool.free(pages_h, claimed_h)
    pool.check_integrity()
    assert pool.num_used == len(owners) - len(pages)
    assert pool.free_units()[: len(pages)].tolist() == pages  # back in front, in their order


P = 4


def _alloc() -> KVAllocator:
    cfg = AllocatorConfig(
        page_size=P,
        num_full_pages=40,
        num_swa_pages=40,
        num_request_slots=4,
        max_pages_per_request=10,
        window_tokens=8,
    )
    return KVAllocator(cfg)


def _filled(tokens: list[int], evict: bool) -> KVAllocator:
    a = _alloc()
    slots = np.arange(1, len(tokens) + 1)
    a.open(slots)
    a.extend(slots, np.array(tokens))
    if evict:
        a.evict_window()
    return a


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=4), st.booleans())
def test_one_request_frees_leave_what_one_batch_free_leaves(tokens: list[int], evict: bool) -> None:
    """One run per free (one request) and many runs (a batch) agree: same tables, mappings,
    owners and free pages (the free stacks hold them in another order)."""
    one, batch = _filled(tokens, evict), _filled(tokens, evict)
    for slot in range(1, len(tokens) + 1):
        one.free(t(slot))
    batch.free(torch.arange(1, len(tokens) + 1))
    for a in (one, batch):
        a.check_integrity()
    for x, y in zip(allocator_state(one)[:4], allocator_state(batch)[:4], strict=True):
        assert torch.equal(x, y)
    for pool_one, pool_batch in ((one.full, batch.full), (one.swa, batch.swa)):
        assert np.array_equal(pool_one.owner, pool_batch.owner)
        assert sorted(pool_one.free_units().tolist()) == sorted(pool_batch.free_units().tolist())


@pytest.mark.parametrize("corrupt", ["repeated page", "no swa page in the window", "foreign"])
def test_free_refuses_a_broken_row_and_changes_nothing(corrupt: str) -> None:
    a = _filled([20, 6], evict=True)
    host = a.host
    if corrupt == "repeated page":
        host.page_table[1, 4] = host.page_table[1, 3]  # a row listing one page twice
    elif corrupt == "no swa page in the window":
        host.full_to_swa[host.page_table[1, 4]] = 0  # an in-window column without its SWA page
    else:
        host.page_table[1, 4] = host.page_table[2, 0]  # another request's page
    before = allocator_state(a)
    with pytest.raises(OwnershipError):
        a.free(t(1))
    assert same_state(before, allocator_state(a))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("emulate", [False, True])
def test_a_free_runs_only_the_device_writes(emulate: bool) -> None:
    """Issue #26: each torch operator costs ~1 us of dispatch on the CPU, ~5 us of launch on
    CUDA. A free decides on the host: no operator where the device tables are the host's, and
    only the two table writes (and the copy of their upload) where they are not."""
    with emulating_device(emulate):
        a = _filled([37, 9], evict=True)
    with _CountOps() as counted:
        a.free(np.array([1]))
    writes = ["aten.index_fill_.int_Scalar", "aten.index_fill_.int_Scalar"]
    assert [op for op in counted.ops if "index_fill" in op] == (writes if emulate else [])
    assert len(counted.ops) <= (len(writes) + 4 if emulate else 0), counted.ops
    a.check_integrity()
