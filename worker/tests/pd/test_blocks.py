"""Unit pairs -> byte blocks under PP: a stage writes exactly its own layers, each at that
layer's index among the destination's layer ids; the stages of any split together write
every byte a single prefill process writes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_common.api.manifest import manifest_of
from dsv4_common.core.layout import build_layout
from dsv4_common.core.presets import load_model_config
from dsv4_worker.mem.page_allocator import PageAllocator
from dsv4_worker.pd.blocks import transfer_blocks

LAYOUT = build_layout(load_model_config("tiny"), 16)
WHOLE = manifest_of(LAYOUT)
SRC_UNITS = {"full_page": 9, "swa_page": 5, "req_slot": 3}
DST_UNITS = {"full_page": 20, "swa_page": 11, "req_slot": 4}
PAIRS = {"full_page": [(1, 7), (2, 8), (4, 3)], "swa_page": [(2, 9)], "req_slot": [(1, 2)]}


def _intervals(blocks: list) -> list[tuple[str, int, int]]:  # type: ignore[type-arg]
    """The destination byte ranges written, merged where they touch: (region, start, end)."""
    spans = sorted((b.region, b.dst_offset, b.dst_offset + b.nbytes) for b in blocks)
    merged: list[tuple[str, int, int]] = []
    for region, lo, hi in spans:
        if merged and merged[-1][0] == region and merged[-1][2] >= lo:
            assert merged[-1][2] == lo, f"overlapping writes in {region}"
            merged[-1] = (region, merged[-1][1], hi)
        else:
            merged.append((region, lo, hi))
    return merged


@given(st.lists(st.integers(1, 3), min_size=1, max_size=6).filter(lambda s: sum(s) <= 6))
def test_the_stages_of_a_split_write_what_one_process_writes(sizes: list[int]) -> None:
    ids = LAYOUT.layer_ids
    cuts = [0]
    for n in sizes:
        cuts.append(min(cuts[-1] + n, len(ids)))
    cuts[-1] = len(ids)
    single = transfer_blocks(WHOLE, WHOLE, SRC_UNITS, DST_UNITS, PAIRS)
    every_stage = []
    for lo, hi in itertools.pairwise(cuts):
        if lo < hi:
            stage = manifest_of(LAYOUT.select(ids[lo:hi]))
            every_stage += transfer_blocks(stage, WHOLE, SRC_UNITS, DST_UNITS, PAIRS)
    # Together (no byte twice: _intervals refuses overlaps) they write what one process does.
    assert _intervals(every_stage) == _intervals(single)


@pytest.mark.parametrize("start", [0, 2, 5])
def test_a_stage_writes_its_layers_at_the_destinations_layer_index(start: int) -> None:
    ids = LAYOUT.layer_ids
    stage = manifest_of(LAYOUT.select(ids[start:]))
    blocks = transfer_blocks(stage, WHOLE, SRC_UNITS, DST_UNITS, {"full_page": [(1, 7)]})
    for c in stage.components:
        if c.index_space != "full_page":
            continue
        dst_layers = next(d.layer_ids for d in WHOLE.components if d.name == c.name)
        for src_l, layer_id in enumerate(c.layer_ids):
            dst_l = dst_layers.index(layer_id)
            want_src = (src_l * SRC_UNITS["full_page"] + 1) * c.unit_bytes
            want_dst = (dst_l * DST_UNITS["full_page"] + 7) * c.unit_bytes
            assert any(
                b.region == c.name
                and b.src_offset <= want_src < b.src_offset + b.nbytes
                and b.dst_offset - b.src_offset == want_dst - want_src
                for b in blocks
            ), (c.name, layer_id)
    regions = {b.region for b in blocks}
    assert regions == {c.name for c in stage.components if c.index_space == "full_page"}


@given(st.integers(1, 8), st.integers(0, 6), st.integers(0, 6), st.booleans())
def test_runs_from_the_page_allocator_write_one_block_per_layer(
    num_pages: int, src_held: int, dst_held: int, recycled: bool
) -> None:
    """A request's full pages on each side come from a PageAllocator where earlier requests
    hold pages (and, if `recycled`, one that ended left its pages to this one): the write is
    one block per component and layer, not one per page (GPU writes cost ~8-10 us per block;
    docs/pd.md "On a GPU")."""

    def request_pages(held: int) -> list[int]:
        pool = PageAllocator("full", 32)
        pool.alloc(torch.full((held,), 1))
        if recycled:
            ended = pool.alloc(torch.full((num_pages,), 2))
            pool.free(ended, torch.full((num_pages,), 2))
        return pool.alloc(torch.full((num_pages,), 3)).tolist()

    src, dst = request_pages(src_held), request_pages(dst_held)
    units = {"full_page": 33, "swa_page": 1, "req_slot": 1}
    pairs = {"full_page": list(zip(src, dst, strict=True))}
    blocks = transfer_blocks(WHOLE, WHOLE, units, units, pairs)
    full = [c for c in WHOLE.components if c.index_space == "full_page"]
    assert len(blocks) == sum(len(c.layer_ids) for c in full)
    assert {b.nbytes for b in blocks} == {num_pages * c.unit_bytes for c in full}
