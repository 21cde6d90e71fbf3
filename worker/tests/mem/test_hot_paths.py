"""The allocator's hot paths after the argument checks moved to the boundary (issue #26): the
checks still refuse what they refused, each at the public entry, and the decode cache
(`next_slot`) agrees with the page table, which `check_integrity` verifies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import memory_state, same_state, small_memory, t

from dsv4_worker.mem.args import int64_vector
from dsv4_worker.mem.errors import (
    IntegrityError,
    InvalidArgument,
    OwnershipError,
    RequestTooLong,
)
from dsv4_worker.mem.memory import KVMemory

CPU = torch.device("cpu")
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


@given(st.lists(st.integers(0, 100), max_size=8), st.sampled_from(INT_DTYPES))
def test_a_plain_int64_vector_passes_through_and_others_are_converted(
    values: list[int], dtype: torch.dtype
) -> None:
    x = torch.tensor(values, dtype=dtype)
    out = int64_vector(x, "slots", CPU)
    assert out.dtype == torch.int64 and out.tolist() == values
    assert (out is x) == (dtype == torch.int64)  # no copy, no new tensor on the hot path


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([[1]]), [1]])
def test_the_internal_entries_are_reached_only_through_checked_boundaries(bad: object) -> None:
    mem = small_memory("tiny")
    slots = mem.open(2)
    before = memory_state(mem)
    for op in (mem.free, mem.pages.free, mem.req_slots.free, mem.req_slots.check_owned):
        with pytest.raises(InvalidArgument):
            op(bad)  # type: ignore[arg-type]
    assert same_state(before, memory_state(mem))
    mem.free(slots.to(torch.int32))  # converted once at the boundary, then freed
    assert [u.used for u in mem.usage()] == [0, 0, 0]


def test_the_unconverted_entries_still_check_ranges_and_owners() -> None:
    mem = small_memory("tiny")
    pages = mem.pages.full
    got = pages.alloc(t(3, 3))
    for bad_pages, owners in ((t(0, 1), t(3, 3)), (t(1, 99), t(3, 3)), (got, t(3, 0))):
        with pytest.raises(OwnershipError):
            pages.free_checked(bad_pages, owners)
    with pytest.raises(OwnershipError):
        pages.free_checked(got, t(3, 4))  # not the owner
    pages.free_checked(got, t(3, 3))
    pages.check_integrity()


def _memory_with(
    lengths: list[int], page: int = 16, max_pages: int = 4, *, host: bool = True
) -> KVMemory:
    """`host=False`: the allocator takes its off-CPU paths (clamped gathers, one stacked read),
    which CUDA runs; CPU tensors run them just as well, so CI covers them without a GPU."""
    mem = small_memory("tiny", page_size=page, full_pages=40, swa_pages=40, max_pages=max_pages)
    mem.pages._host = host
    slots = mem.open(len(lengths))
    mem.pages.extend(slots, torch.tensor(lengths))
    return mem


@pytest.mark.parametrize(
    ("lengths", "slots", "error"),
    [
        ([5, 7], t(1, 2, 1), OwnershipError),  # steady (no page boundary), repeated
        ([16, 7], t(1, 2, 1), OwnershipError),  # at a boundary, repeated
        ([5], t(1, 0), InvalidArgument),  # the reserved slot reads 0 mod P: checked path
        ([5], t(1, 2), OwnershipError),  # a closed slot
        ([5], t(1, 9), InvalidArgument),  # out of range: the gather refuses it
        ([64, 5], t(2, 1), RequestTooLong),  # full (4 pages of 16) at a boundary
    ],
)
@pytest.mark.parametrize("host", [True, False])
def test_decode_refuses_on_both_paths_and_changes_nothing(
    lengths: list[int], slots: torch.Tensor, error: type[Exception], host: bool
) -> None:
    mem = _memory_with(lengths, host=host)
    before = memory_state(mem)
    verdict = mem.pages.can_decode(slots)
    with pytest.raises(error) as info:
        mem.pages.decode(slots)
    assert type(verdict.refusal) is type(info.value)
    assert str(verdict.refusal) == str(info.value)
    assert same_state(before, memory_state(mem))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=4),
    st.integers(1, 40),
    st.sampled_from([16, 32, 64]),  # tiny's layout needs pages divisible by 16
    st.booleans(),
)
def test_decode_returns_the_page_table_slot_of_each_new_token(
    lengths: list[int], steps: int, page: int, host: bool
) -> None:
    max_pages = (max(lengths) + steps) // page + 2
    mem = _memory_with(lengths, page=page, max_pages=max_pages, host=host)
    a = mem.pages
    slots = torch.arange(1, len(lengths) + 1)
    for _ in range(steps):
        n = a.num_tokens[slots].clone()
        out = a.decode(slots)
        want = a.page_table[slots, n // page] * page + n % page  # the slot of token n
        assert torch.equal(out, want)
        a.check_integrity()


def test_a_stale_next_slot_is_an_integrity_error() -> None:
    mem = _memory_with([5, 16])
    mem.pages.next_slot[1] += 1  # no longer the slot of request 1's next token
    with pytest.raises(IntegrityError, match="next_slot"):
        mem.check_integrity()
    mem = _memory_with([5])
    mem.pages.next_slot[3] = 16  # a closed slot
    with pytest.raises(IntegrityError, match="closed slot has a next_slot"):
        mem.check_integrity()
