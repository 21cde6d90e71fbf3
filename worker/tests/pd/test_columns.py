"""The one pure function of what a PD transfer step moves: over any chunking, every full
column travels exactly once, the last step's SWA columns are exactly the ones decode's
`alloc_tail` maps, and the scheduler's preallocation need equals what `alloc_tail` takes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import small_memory

from dsv4_common.core.index_space import pages_for_tokens, tail_pages
from dsv4_worker.pd.columns import send_step, tail_cols
from dsv4_worker.sched.scheduler import Phase, ReqView, SchedulerConfig, prealloc_need


@settings(max_examples=300, deadline=None)
@given(
    page=st.sampled_from([1, 4, 16, 32]),
    retained=st.integers(1, 200),
    n=st.integers(1, 2000),
    chunks=st.lists(st.integers(1, 300), min_size=1, max_size=20),
)
def test_every_column_once(page: int, retained: int, n: int, chunks: list[int]) -> None:
    sent, done, seen = 0, 0, []
    for c in chunks:
        done = min(n, done + c)
        if done == n:
            break
        step = send_step(sent, done, last=False, page_size=page, retained_tokens=retained)
        assert not step.swa_cols and not step.request_state
        assert step.full_cols.stop * page <= done  # only whole pages before the end
        seen += list(step.full_cols)
        sent = step.full_cols.stop
    last = send_step(sent, n, last=True, page_size=page, retained_tokens=retained)
    seen += list(last.full_cols)
    assert seen == list(range(pages_for_tokens(n, page)))
    assert last.request_state
    assert last.swa_cols == tail_cols(n, page, retained)
    assert len(last.swa_cols) == tail_pages(n, page, retained)
    assert last.swa_cols.stop == pages_for_tokens(n, page)
    assert (last.swa_cols.start * page) <= max(0, n - retained)  # the window is covered


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8 * 16))
def test_alloc_tail_maps_exactly_the_tail_columns(n: int) -> None:
    mem = small_memory(full_pages=24, swa_pages=24, max_pages=8)
    slot = mem.open(1)
    mem.pages.alloc_tail(slot, torch.tensor([n]))
    full, swa = mem.pages.request_pages(int(slot[0]))
    retained = mem.config.retained_tokens
    mapped = [c for c, s in enumerate(swa.tolist()) if s > 0]
    assert mapped == list(tail_cols(n, 16, retained))
    config = SchedulerConfig(16, 64, 8 * 16, retained_tokens=retained)
    need = prealloc_need(ReqView(0, Phase.PREALLOC, n, 4), config)
    used = {u.pool: u.used for u in mem.usage()}
    assert (need.full_pages, need.swa_pages, need.request_slots) == (
        used["full"],
        used["swa"],
        used["req_slots"],
    )
    assert full.numel() == pages_for_tokens(n, 16)
    mem.free(slot)
    mem.check_integrity()
