"""The vectorized index conversions agree elementwise with the scalar ones in core."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dsv4_common.core import index_space as scalar
from dsv4_worker.mem import index as vec
from dsv4_worker.mem.runs import pages_for, runs

PAGES = st.sampled_from([4, 16, 64, 256])
RATIOS = st.sampled_from([1, 4, 16])
VALUES = st.lists(st.integers(0, 1 << 20), min_size=1, max_size=64)


@settings(max_examples=60, deadline=None)
@given(values=VALUES, page=PAGES, ratio=RATIOS, ring=st.sampled_from([4, 8, 16, 32]))
def test_vectorized_conversions_match_scalar(
    values: list[int], page: int, ratio: int, ring: int
) -> None:
    assume(page % ratio == 0)  # the layout guarantees page identity
    x = torch.tensor(values, dtype=torch.int64)
    offsets = x % page
    cases = [
        (
            vec.full_page_of(x, page),
            [scalar.full_page_of(scalar.FullSlot(v), page) for v in values],
        ),
        (vec.swa_page_of(x, page), [scalar.swa_page_of(scalar.SwaSlot(v), page) for v in values]),
        (
            vec.full_slot_at(x, offsets, page),
            [scalar.full_slot_at(scalar.FullPage(v), v % page, page) for v in values],
        ),
        (
            vec.swa_slot_at(x, offsets, page),
            [scalar.swa_slot_at(scalar.SwaPage(v), v % page, page) for v in values],
        ),
        (
            vec.compressed_row_of(x, ratio),
            [scalar.compressed_row_of(scalar.FullSlot(v), ratio) for v in values],
        ),
        (
            vec.completes_block(x, ratio).long(),
            [int(scalar.completes_block(scalar.FullSlot(v), ratio)) for v in values],
        ),
        (
            vec.compressed_page_of(x, ratio, page),
            [scalar.compressed_page_of(v, ratio, page) for v in values],
        ),
        (
            vec.page_state_row(x, page, ring),
            [scalar.page_state_row(scalar.SwaSlot(v), page, ring) for v in values],
        ),
        (
            vec.request_state_row(x % 7, x, ring),
            [scalar.request_state_row(scalar.ReqSlot(v % 7), v, ring) for v in values],
        ),
        (vec.pages_for_tokens(x, page), [scalar.pages_for_tokens(v, page) for v in values]),
        (vec.floor_to_page(x, page), [scalar.floor_to_page(v, page) for v in values]),
    ]
    for got, want in cases:
        assert got.tolist() == want


def test_page_identity_compressed_page_equals_full_page() -> None:
    slots = torch.arange(0, 4096)
    for ratio in (4, 16, 128):
        rows = vec.compressed_row_of(slots, ratio)
        assert torch.equal(vec.compressed_page_of(rows, ratio, 256), vec.full_page_of(slots, 256))


def test_full_to_swa_slots_maps_through_page_and_keeps_none() -> None:
    page = 4
    mapping = torch.tensor([0, 3, 0, 1])  # full page 1 -> SWA page 3, page 3 -> 1, page 2 none
    full_slots = torch.tensor([4, 7, 8, 13, 0])
    got = vec.full_to_swa_slots(full_slots, mapping, page)
    assert got.tolist() == [12, 15, 0, 5, 0]


@settings(max_examples=60, deadline=None)
@given(values=VALUES, page=st.sampled_from([1, 4, 12, 16, 100, 256]))
def test_host_page_counts_match_the_index_conversions(values: list[int], page: int) -> None:
    """The allocator's numpy page arithmetic (`runs.pages_for`) agrees with the torch one."""
    x = torch.tensor(values, dtype=torch.int64)
    got = pages_for(x.numpy(), page)
    assert got.tolist() == vec.pages_for_tokens(x, page).tolist()
    assert got.tolist() == [scalar.pages_for_tokens(v, page) for v in values]


@given(st.lists(st.integers(0, 6), min_size=1, max_size=8))
def test_runs_number_each_run_from_zero(counts: list[int]) -> None:
    c = np.array(counts, dtype=np.int64)
    batch, within = runs(c, int(c.sum()))
    want = [(i, j) for i, n in enumerate(counts) for j in range(n)]
    got_batch = [0] * len(want) if batch is None else batch.tolist()
    assert list(zip(got_batch, within.tolist(), strict=True)) == want
