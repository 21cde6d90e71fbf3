"""`ring_writers`: writing only the rows it keeps leaves every compressor ring row as writing
the whole batch in position order does (the last writer wins), with no two kept rows sharing a
ring row, for request rings and per-SWA-page rings alike."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.engine.paged import ring_writers


def _unit_and_row(pos: int, slot: int, ring_rows: int, page_size: int | None) -> tuple[int, ...]:
    unit = (slot,) if page_size is None else (slot, pos // page_size)
    return (*unit, pos % ring_rows)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int, int | None]:
    """Segments (start, length) of distinct requests, a ring size, a page size or None."""
    ring_rows = draw(st.integers(1, 12))
    page_size = draw(st.one_of(st.none(), st.integers(1, 6).map(lambda k: 4 * k)))
    segments = draw(
        st.lists(st.tuples(st.integers(0, 200), st.integers(1, 70)), min_size=1, max_size=6)
    )
    return segments, ring_rows, page_size


@settings(max_examples=400, deadline=None)
@given(batches())
def test_the_kept_rows_are_each_ring_rows_last_writer(
    batch: tuple[list[tuple[int, int]], int, int | None],
) -> None:
    segments, ring_rows, page_size = batch
    positions = np.concatenate([np.arange(s, s + n) for s, n in segments]).astype(np.int64)
    ends = np.concatenate([np.full(n, s + n) for s, n in segments]).astype(np.int64)
    slots = np.concatenate([np.full(n, i) for i, (_, n) in enumerate(segments)])
    last_writer: dict[tuple[int, ...], int] = {}
    for row, (pos, slot) in enumerate(zip(positions.tolist(), slots.tolist(), strict=True)):
        last_writer[_unit_and_row(pos, slot, ring_rows, page_size)] = row  # position order
    keep = ring_writers(positions, ends, ring_rows, page_size)
    kept = list(range(len(positions))) if keep is None else keep.tolist()
    assert kept == sorted(last_writer.values())
    if keep is not None:
        assert keep.dtype == np.int64 and len(keep) < len(positions)


def test_decode_keeps_every_row_without_an_index() -> None:
    positions = np.array([5, 300, 17], dtype=np.int64)  # one token a request
    assert ring_writers(positions, positions + 1, 8, None) is None
    assert ring_writers(positions, positions + 1, 8, 256) is None
