"""The free paths of issue #26 item 2: `claim` checks ownership and repeats in one scatter-add
(`CLAIM_BIAS`), and one request's free on the CPU runs in numpy (`host_free`). Both refuse
exactly what the old tag-per-page claim refused, changing nothing when they do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import allocator_state, same_state, t
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.errors import OwnershipError
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.page_allocator import CLAIM_BIAS, PageAllocator

NUM_PAGES = 12


def _pool(owners: list[int]) -> PageAllocator:
    pool = PageAllocator("full", NUM_PAGES)
    pool.alloc(torch.tensor(owners, dtype=torch.int64))
    return pool


def _state(pool: PageAllocator) -> tuple[list[int], list[int]]:
    return pool.owner.tolist(), pool.free_units().tolist()


def _valid(pool: PageAllocator, pages: list[int], owners: list[int]) -> bool:
    """The old rule: each page listed once, by its owner."""
    held = pool.owner.tolist()
    return len(set(pages)) == len(pages) and all(
        held[p] == o for p, o in zip(pages, owners, strict=True)
    )


@st.composite
def _claims(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Pool owners, then pages to claim with their claimed owners: mostly the real owners,
    some repeated, some wrong, including k * owner for a page listed k times (the case a plain
    subtraction of owners would let through)."""
    owners = draw(st.lists(st.integers(1, 6), min_size=1, max_size=NUM_PAGES))
    pool_pages = list(range(1, len(owners) + 1))  # a fresh pool hands out 1, 2, ... in order
    pages = draw(st.lists(st.sampled_from(pool_pages), max_size=8))
    claimed = []
    for page in pages:
        real = owners[page - 1]
        claimed.append(draw(st.sampled_from([real, real, real + 1, pages.count(page) * real])))
    return owners, pages, claimed


@settings(max_examples=300, deadline=None)
@given(_claims())
def test_claim_refuses_exactly_what_the_old_rule_refused(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    owners, pages, claimed = case
    pool = _pool(owners)
    before = _state(pool)
    valid = _valid(pool, pages, claimed)
    page_t, owner_t = t(*pages), t(*claimed)
    if not valid:
        with pytest.raises(OwnershipError):
            pool.claim(page_t, owner_t)
        assert _state(pool) == before
        return
    token = pool.claim(page_t, owner_t)
    assert all(pool.owner[p] < 0 for p in pages)
    pool.unclaim(page_t, token)
    assert _state(pool) == before
    pool.claim(page_t, owner_t)
    pool.release_claimed(page_t)
    pool.check_integrity()
    assert pool.num_used == len(owners) - len(pages)


@settings(max_examples=300, deadline=None)
@given(_claims())
def test_claim_host_refuses_exactly_what_claim_refuses(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    owners, pages, claimed = case
    owner = claimed[0] if claimed else 1
    pool = _pool(owners)
    before = _state(pool)
    host_pages = t(*pages).numpy()
    if not _valid(pool, pages, [owner] * len(pages)):
        with pytest.raises(OwnershipError):
            pool.claim_host(host_pages, owner)
        assert _state(pool) == before
        return
    pool.claim_host(host_pages, owner)
    pool.release_host(host_pages)
    pool.check_integrity()
    assert pool.num_used == len(owners) - len(pages)


def test_owners_at_or_past_the_claim_bias_are_refused_at_the_boundary() -> None:
    pool = _pool([1])
    with pytest.raises(OwnershipError, match="owners must be in"):
        pool.free(t(1), t(CLAIM_BIAS + 1))
    pool.check_integrity()


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
    slots = torch.arange(1, len(tokens) + 1)
    a.open(slots)
    a.extend(slots, t(*tokens))
    if evict:
        a.evict_window()
    return a


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=4), st.booleans())
def test_one_request_frees_leave_what_one_batch_free_leaves(tokens: list[int], evict: bool) -> None:
    """The numpy path (one request) and the torch path (a batch) agree: same table, mappings,
    owners and free pages (the free stacks hold them in another order)."""
    one, batch = _filled(tokens, evict), _filled(tokens, evict)
    for slot in range(1, len(tokens) + 1):
        one.free(t(slot))
    batch.free(torch.arange(1, len(tokens) + 1))
    for a in (one, batch):
        a.check_integrity()
    for x, y in zip(allocator_state(one)[:5], allocator_state(batch)[:5], strict=True):
        assert torch.equal(x, y)
    for pool_one, pool_batch in ((one.full, batch.full), (one.swa, batch.swa)):
        assert torch.equal(pool_one.owner, pool_batch.owner)
        free_one = pool_one.free_units().tolist()
        assert sorted(free_one) == sorted(pool_batch.free_units().tolist())


@pytest.mark.parametrize("corrupt", ["repeated page", "no swa page in the window"])
def test_one_request_free_refuses_a_broken_row_and_changes_nothing(corrupt: str) -> None:
    a = _filled([20, 6], evict=True)
    if corrupt == "repeated page":
        a.page_table[1, 4] = a.page_table[1, 3]  # a row listing one page twice
    else:
        a.full_to_swa[a.page_table[1, 4]] = 0  # an in-window column without its SWA page
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


def test_one_request_free_on_the_cpu_runs_no_torch_operator_past_reading_its_slot() -> None:
    """Issue #26: each torch operator costs ~1 us of dispatch, and a request's free ran ~25."""
    a, slot = _filled([37, 9], evict=True), t(1)
    with _CountOps() as counted:
        a.free(slot)
    assert counted.ops == ["aten._local_scalar_dense.default"]  # int(slots)
    a.check_integrity()
