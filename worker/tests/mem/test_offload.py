"""CPU offload + reload restores every byte of every component of a request."""

from __future__ import annotations

import pytest
import torch
from mem_helpers import (
    fill_random,
    memory_state,
    request_bytes,
    same_bytes,
    same_state,
    small_memory,
    t,
)

from dsv4_worker.mem.errors import OutOfPages
from dsv4_worker.mem.offload import offload_request, reload_request


@pytest.mark.parametrize(("preset", "draft"), [("tiny", 0), ("tiny", 2), ("hybrid-tiny", 0)])
def test_offload_then_reload_restores_every_byte(preset: str, draft: int) -> None:
    mem = small_memory(preset, draft_tokens=draft, full_pages=30, swa_pages=14)
    slots = mem.open(3)
    mem.pages.extend(slots, t(70, 9, 33))
    mem.pages.evict_window(slots[:1])  # request 1 keeps only its window tail: a sparse SWA mask
    fill_random(mem, seed=1)
    target, others = int(slots[0]), [int(s) for s in slots[1:]]
    want = request_bytes(mem, target)
    mask_before = (mem.pages.request_pages(target)[1] > 0).tolist()
    assert mask_before.count(False) > 0 and mask_before.count(True) > 0

    snapshot = offload_request(mem, target)
    assert snapshot.swa_mask.tolist() == mask_before
    assert snapshot.nbytes == sum(v.numel() for v in want.values())
    mem.check_integrity()
    # Reuse the freed units so reload lands elsewhere, and scribble on them.
    squatter = mem.open(1)
    mem.pages.extend(squatter, t(40))
    fill_random(mem, seed=2)
    others_after_scribble = {s: request_bytes(mem, s) for s in others}
    restored = reload_request(mem, snapshot)
    mem.check_integrity()

    assert int(mem.pages.num_tokens[restored]) == 70
    assert (mem.pages.request_pages(restored)[1] > 0).tolist() == mask_before
    assert same_bytes(request_bytes(mem, restored), want)
    for s in others:  # reload writes only the restored request's units
        assert same_bytes(request_bytes(mem, s), others_after_scribble[s])


def test_offload_keeps_other_requests_untouched() -> None:
    mem = small_memory("tiny")
    slots = mem.open(2)
    mem.pages.extend(slots, t(20, 20))
    fill_random(mem, seed=3)
    keep = request_bytes(mem, int(slots[1]))
    offload_request(mem, int(slots[0]))
    assert same_bytes(request_bytes(mem, int(slots[1])), keep)
    assert [u.used for u in mem.usage()] == [2, 2, 1]


def test_reload_that_does_not_fit_changes_nothing() -> None:
    mem = small_memory("tiny", full_pages=8, swa_pages=4)
    slots = mem.open(1)
    mem.pages.extend(slots, t(60))
    snapshot = offload_request(mem, int(slots[0]))
    hog = mem.open(1)
    mem.pages.extend(hog, t(64))  # 4 full + 4 SWA pages: nothing left for the snapshot
    before = memory_state(mem)
    with pytest.raises(OutOfPages):
        reload_request(mem, snapshot)
    assert same_state(before, memory_state(mem))
    mem.free(hog)
    slot = reload_request(mem, snapshot)
    assert int(mem.pages.num_tokens[slot]) == 60
    assert torch.equal(mem.pages.request_pages(slot)[1] > 0, snapshot.swa_mask)
