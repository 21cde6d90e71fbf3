"""The allocator's hot paths after the checks moved to the host (issues #26 and #38): the
checks still refuse what they refused, each at the public entry, on both the CPU's tables and
the device's separate copies (DSV4_EMULATE_DEVICE=1, CUDA's code), and the device copies stay
equal to the host's, which `check_integrity` verifies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import memory_state, same_state, small_memory, t

from dsv4_worker.mem.args import host_ints
from dsv4_worker.mem.errors import (
    IntegrityError,
    InvalidArgument,
    OwnershipError,
    RequestTooLong,
)
from dsv4_worker.mem.memory import KVMemory

CPU = torch.device("cpu")
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


@given(st.lists(st.integers(0, 100), max_size=8), st.sampled_from(INT_DTYPES), st.booleans())
def test_a_plain_int64_array_passes_through_and_others_are_converted(
    values: list[int], dtype: torch.dtype, as_numpy: bool
) -> None:
    x: object = torch.tensor(values, dtype=dtype)
    if as_numpy:
        x = torch.tensor(values, dtype=dtype).numpy()
    out = host_ints(x, "slots", CPU)
    assert out.dtype == np.int64 and out.tolist() == values
    assert (out is x) == (as_numpy and dtype == torch.int64)  # no copy on the hot path


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([[1]]), [1], np.array([1.0])])
def test_the_internal_entries_are_reached_only_through_checked_boundaries(bad: object) -> None:
    mem = small_memory("tiny")
    slots = mem.open(2)
    before = memory_state(mem)
    for op in (mem.free, mem.pages.free, mem.req_slots.free, mem.req_slots.check_owned):
        with pytest.raises(InvalidArgument):
            op(bad)
    assert same_state(before, memory_state(mem))
    mem.free(torch.from_numpy(slots).to(torch.int32))  # converted once at the boundary
    assert [u.used for u in mem.usage()] == [0, 0, 0]


def test_the_page_pools_check_ranges_and_owners() -> None:
    mem = small_memory("tiny")
    pages = mem.pages.full
    got = pages.alloc(t(3, 3))
    for bad_pages, owners in ((t(0, 1), t(3, 3)), (t(1, 99), t(3, 3)), (got, t(3, 0))):
        with pytest.raises(OwnershipError):
            pages.free(bad_pages, owners)
    with pytest.raises(OwnershipError):
        pages.free(got, t(3, 4))  # not the owner
    pages.free(got, t(3, 3))
    pages.check_integrity()


def _memory_with(
    lengths: list[int], page: int = 16, max_pages: int = 4, *, emulate: bool = False
) -> KVMemory:
    """`emulate`: the device's tables apart from the host's, written by uploads (CUDA's code,
    which CI so covers without a GPU)."""
    mem = small_memory(
        "tiny", page_size=page, full_pages=40, swa_pages=40, max_pages=max_pages, emulate=emulate
    )
    slots = mem.open(len(lengths))
    mem.pages.extend(slots, np.array(lengths))
    return mem


@pytest.mark.parametrize(
    ("lengths", "slots", "error"),
    [
        ([5, 7], t(1, 2, 1), OwnershipError),  # steady (no page boundary), repeated
        ([16, 7], t(1, 2, 1), OwnershipError),  # at a boundary, repeated
        ([5], t(1, 0), InvalidArgument),  # the reserved slot
        ([5], t(1, 2), OwnershipError),  # a closed slot
        ([5], t(1, 9), InvalidArgument),  # out of range
        ([64, 5], t(2, 1), RequestTooLong),  # full (4 pages of 16) at a boundary
    ],
)
@pytest.mark.parametrize("emulate", [False, True])
def test_decode_refuses_on_both_paths_and_changes_nothing(
    lengths: list[int], slots: torch.Tensor, error: type[Exception], emulate: bool
) -> None:
    mem = _memory_with(lengths, emulate=emulate)
    before = memory_state(mem)
    verdict = mem.pages.can_decode(slots)
    with pytest.raises(error) as info:
        mem.pages.decode(slots.numpy())
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
    lengths: list[int], steps: int, page: int, emulate: bool
) -> None:
    max_pages = (max(lengths) + steps) // page + 2
    mem = _memory_with(lengths, page=page, max_pages=max_pages, emulate=emulate)
    a = mem.pages
    slots = np.arange(1, len(lengths) + 1)
    for _ in range(steps):
        n = a.num_tokens[slots].clone()
        out = a.decode(slots)
        # the device's table, read after the decode wrote it: the slot of token n
        want = a.page_table[torch.from_numpy(slots), n // page] * page + n % page
        assert torch.equal(out, want)
        a.check_integrity()


def test_a_device_table_that_drifts_from_the_host_is_an_integrity_error() -> None:
    mem = _memory_with([5, 16], emulate=True)
    mem.pages.page_table[1, 0] += 1  # the device's copy only
    with pytest.raises(IntegrityError, match="device's page_table differs"):
        mem.check_integrity()
    mem = _memory_with([5, 40], emulate=True)
    mem.pages.full_to_swa[int(mem.pages.host.page_table[2, 0])] = 0
    with pytest.raises(IntegrityError, match="device's full_to_swa differs"):
        mem.check_integrity()


def test_shared_tables_are_the_host_state_itself() -> None:
    mem = _memory_with([5, 16])
    a = mem.pages
    assert a.page_table.data_ptr() == a.host.page_table.ctypes.data
    assert a.full_to_swa.data_ptr() == a.host.full_to_swa.ctypes.data
    mem = _memory_with([5, 16], emulate=True)
    assert mem.pages.page_table.data_ptr() != mem.pages.host.page_table.ctypes.data
