"""Arguments outside the contract: each raises the package's own error and changes nothing.

Found by the randomized stress in `mem_stress.py`, which the last test runs for a short while.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from mem_helpers import allocator_state, memory_state, same_state, small_memory, t
from mem_stress import GEOMETRIES, run_stress

from dsv4_worker.mem.errors import (
    InvalidArgument,
    KVMemoryError,
    OutOfPages,
    OwnershipError,
    RequestTooLong,
)
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.mem.offload import offload_request, reload_request
from dsv4_worker.mem.page_allocator import PageAllocator

I64_MAX = 2**63 - 1
NARROW_DTYPES = [torch.int32, torch.int16, torch.int8, torch.uint8]


def _busy_memory() -> KVMemory:
    """Slots 1-3 open with 20, 5 and 0 tokens; slots 4-5 closed."""
    mem = small_memory("tiny")
    assert sorted(mem.open(3).tolist()) == [1, 2, 3]
    mem.pages.extend(t(1, 2, 3), t(20, 5, 0))
    return mem


def _refused(mem: KVMemory, op: Callable[[], object], error: type[KVMemoryError]) -> None:
    before = memory_state(mem)
    with pytest.raises(error):
        op()
    assert same_state(before, memory_state(mem))
    mem.check_integrity()


@pytest.mark.parametrize("dtype", NARROW_DTYPES)
def test_free_of_narrow_integer_slots_frees_exactly_like_int64(dtype: torch.dtype) -> None:
    mem = _busy_memory()
    mem.free(t(1).to(dtype))  # was: IndexError after the pages were already released
    mem.pages.free(t(2, 3).to(dtype))
    mem.req_slots.free(t(2, 3).to(dtype))
    assert [u.used for u in mem.usage()] == [0, 0, 0]
    mem.check_integrity()


@pytest.mark.parametrize("dtype", NARROW_DTYPES)
def test_every_operation_accepts_any_integer_dtype(dtype: torch.dtype) -> None:
    a = _busy_memory().pages
    ref = _busy_memory().pages
    for alloc, cast in ((a, lambda x: x.to(dtype)), (ref, lambda x: x)):
        outputs = [
            alloc.extend(cast(t(1, 2)), cast(t(30, 4))),
            alloc.decode(cast(t(1, 3))),
            torch.tensor(alloc.evict_window(cast(t(1)))),
        ]
        alloc.free(cast(t(3)))
        alloc.open(cast(t(4)))
        alloc.alloc_tail(cast(t(4)), cast(t(40)))
        alloc.free(cast(t(4)))
        alloc.open(cast(t(4)))
        alloc.alloc_sparse(cast(t(4)), cast(t(40)), cast(t(16)))
        outputs.append(alloc.decode(cast(t(4))))
        alloc.check_integrity()
        if alloc is a:
            got = outputs
    assert same_state(allocator_state(a), allocator_state(ref))
    assert all(torch.equal(x, y) for x, y in zip(got, outputs, strict=True))


def test_open_of_the_reserved_slot_0_is_refused() -> None:
    mem = _busy_memory()
    _refused(mem, lambda: mem.pages.open(t(0)), InvalidArgument)
    _refused(mem, lambda: mem.pages.open(t(4, 0)), InvalidArgument)


@pytest.mark.parametrize("slot", [0, -1, -6, 6, 99, 2**40, -(2**63)])
@pytest.mark.parametrize(
    "op",
    ["open", "free", "extend", "decode", "evict_window", "alloc_tail", "alloc_sparse", "mem.free"],
)
def test_negative_reserved_or_out_of_range_slots_raise_invalid_argument(op: str, slot: int) -> None:
    mem = _busy_memory()
    a = mem.pages
    calls: dict[str, Callable[[torch.Tensor], object]] = {
        "open": a.open,
        "free": a.free,
        "extend": lambda s: a.extend(s, torch.ones_like(s)),
        "decode": a.decode,
        "evict_window": a.evict_window,
        "alloc_tail": lambda s: a.alloc_tail(s, torch.ones_like(s)),
        "alloc_sparse": lambda s: a.alloc_sparse(s, torch.ones_like(s), torch.zeros_like(s)),
        "mem.free": mem.free,
    }
    _refused(mem, lambda: calls[op](t(1, slot)), InvalidArgument)
    _refused(mem, lambda: calls[op](t(slot)), InvalidArgument)


@pytest.mark.parametrize("slot", [0, -1, 6, 2**40])
def test_request_pages_and_offload_refuse_slots_outside_the_table(slot: int) -> None:
    mem = _busy_memory()
    _refused(mem, lambda: mem.pages.request_pages(slot), InvalidArgument)  # -1 used to wrap
    _refused(mem, lambda: offload_request(mem, slot), InvalidArgument)


@pytest.mark.parametrize("huge", [2**62, I64_MAX, I64_MAX - 19])
def test_extend_near_int64_max_is_too_long_not_an_overflow(huge: int) -> None:
    mem = _busy_memory()
    a = mem.pages
    _refused(mem, lambda: a.extend(t(1), t(huge)), RequestTooLong)  # 20 + huge overflows int64
    _refused(mem, lambda: a.extend(t(3, 1), t(1, huge)), RequestTooLong)
    assert isinstance(a.can_extend(t(1), t(huge)).refusal, RequestTooLong)
    _refused(mem, lambda: a.alloc_tail(t(1), t(huge)), OwnershipError)  # not fresh: first
    fresh = mem.open(1)
    _refused(mem, lambda: a.alloc_tail(fresh, t(huge)), RequestTooLong)
    _refused(mem, lambda: a.alloc_sparse(fresh, t(huge), t(0)), RequestTooLong)
    _refused(mem, lambda: a.alloc_sparse(fresh, t(40), t(I64_MAX)), InvalidArgument)


def test_negative_counts_are_invalid_arguments() -> None:
    mem = _busy_memory()
    a = mem.pages
    fresh = mem.open(1)
    for op in (
        lambda: a.extend(t(1, 2), t(3, -1)),
        lambda: a.extend(t(1), t(-(2**63))),
        lambda: a.alloc_tail(fresh, t(-5)),
        lambda: a.alloc_sparse(fresh, t(-(2**63)), t(0)),
        lambda: a.alloc_sparse(fresh, t(40), t(-16)),
        lambda: mem.open(-1),
        lambda: mem.req_slots.alloc(-3),
    ):
        _refused(mem, op, InvalidArgument)


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1.0]),
        torch.tensor([True]),
        torch.tensor([[1]]),
        torch.tensor(1),
        torch.tensor([1], device="meta"),
        [1],
        1,
    ],
    ids=["float", "bool", "2-D", "0-d", "other-device", "list", "int"],
)
def test_malformed_slot_arguments_are_refused_by_every_entry_point(bad: object) -> None:
    mem = _busy_memory()
    a = mem.pages
    one = t(1)
    for op in (
        lambda: a.open(bad),  # type: ignore[arg-type]
        lambda: a.free(bad),  # type: ignore[arg-type]
        lambda: a.extend(bad, one),  # type: ignore[arg-type]
        lambda: a.extend(one, bad),  # type: ignore[arg-type]
        lambda: a.decode(bad),  # type: ignore[arg-type]
        lambda: a.evict_window(bad),  # type: ignore[arg-type]
        lambda: a.alloc_tail(bad, one),  # type: ignore[arg-type]
        lambda: a.alloc_sparse(t(3), bad, t(0)),  # type: ignore[arg-type]
        lambda: a.alloc_sparse(t(3), t(0), bad),  # type: ignore[arg-type]
        lambda: mem.free(bad),  # type: ignore[arg-type]
        lambda: mem.req_slots.free(bad),  # type: ignore[arg-type]
        lambda: mem.req_slots.in_use(bad),  # type: ignore[arg-type]
        lambda: a.full.free(bad, one),  # type: ignore[arg-type]
    ):
        _refused(mem, op, InvalidArgument)
    for verdict in (a.can_extend(bad, one), a.can_extend(one, bad), a.can_decode(bad)):  # type: ignore[arg-type]
        assert isinstance(verdict.refusal, InvalidArgument)


def test_mismatched_shapes_are_refused() -> None:
    mem = _busy_memory()
    a = mem.pages
    fresh = mem.open(1)
    for op in (
        lambda: a.extend(t(1, 2), t(1)),
        lambda: a.extend(t(), t(1)),
        lambda: a.alloc_tail(fresh, t(1, 1)),
        lambda: a.alloc_sparse(fresh, t(40), t(0, 0)),
        lambda: a.full.free(t(1, 2), t(1)),
    ):
        _refused(mem, op, InvalidArgument)


def test_repeated_slots_within_one_batch_are_refused() -> None:
    mem = _busy_memory()
    a = mem.pages
    fresh = mem.open(2)
    f = int(fresh[0])
    for op in (
        lambda: a.open(t(5, 5)),
        lambda: a.free(t(1, 1)),
        lambda: a.extend(t(2, 2), t(1, 1)),
        lambda: a.decode(t(1, 2, 1)),
        lambda: a.evict_window(t(1, 1)),
        lambda: a.alloc_tail(t(f, f), t(8, 8)),
        lambda: a.alloc_sparse(t(f, f), t(8, 8), t(0, 0)),
        lambda: mem.free(t(1, 1)),
    ):
        _refused(mem, op, OwnershipError)


def test_memory_free_is_all_or_nothing_across_pages_and_request_slots() -> None:
    mem = _busy_memory()
    mem.pages.open(t(5))  # open in the page table only: its request slot is not allocated
    before = memory_state(mem)
    with pytest.raises(OwnershipError):
        mem.free(t(1, 5))  # used to free slot 1's and 5's pages, then fail on the slot
    assert same_state(before, memory_state(mem))


def test_memory_open_gives_its_slots_back_when_the_page_table_refuses() -> None:
    mem = small_memory("tiny", slots=2)
    mem.pages.open(t(1))  # the next request slot handed out is 1, already open in the table
    before = memory_state(mem)
    with pytest.raises(OwnershipError):
        mem.open(1)
    assert same_state(before, memory_state(mem))


def test_reload_of_a_snapshot_from_another_layout_fails_before_allocating() -> None:
    src = _busy_memory()
    snapshot = offload_request(src, 1)
    other = small_memory("hybrid-tiny")
    before = memory_state(other)
    with pytest.raises(InvalidArgument):
        reload_request(other, snapshot)
    assert same_state(before, memory_state(other))
    short = small_memory("tiny", max_pages=1)
    with pytest.raises(RequestTooLong):
        reload_request(short, snapshot)
    assert [u.used for u in short.usage()] == [0, 0, 0]
    assert reload_request(_busy_memory(), snapshot) == 4  # the first free slot


def test_page_allocator_checks_its_arguments() -> None:
    pages = PageAllocator("full", 4)
    got = torch.from_numpy(pages.alloc(t(7, 7).to(torch.int32)))
    assert pages.owner[got].tolist() == [7, 7]
    with pytest.raises(InvalidArgument):
        pages.alloc(torch.tensor([7.0]))
    with pytest.raises(InvalidArgument):
        pages.free(got.to(torch.float32), t(7, 7))
    with pytest.raises(InvalidArgument):
        pages.check_owned(got, t(7))
    pages.check_owned(got.to(torch.int16), t(7, 7).to(torch.int32))
    pages.free(got.to(torch.int32), t(7, 7).to(torch.int8))
    assert pages.num_free == 4
    pages.check_integrity()


def test_out_of_pages_is_still_reported_after_the_argument_checks() -> None:
    a = KVAllocator(small_memory("tiny", full_pages=2, swa_pages=2).config)
    a.open(t(1))
    before = allocator_state(a)
    with pytest.raises(OutOfPages):
        a.extend(t(1).to(torch.int32), t(40).to(torch.int16))
    assert same_state(before, allocator_state(a))


@pytest.mark.parametrize("seed", range(len(GEOMETRIES)))
def test_random_stress_finds_no_contract_violation(seed: int) -> None:
    report = run_stress(num_ops=1_500, seed=seed)
    assert report.violations == []
    assert report.raised > 100  # the stress did leave the contract
