"""One request's free on the CPU, in numpy over views of the allocator's tensors (the same
memory). The checks and writes are `KVAllocator.free_checked`'s, in the same order: a numpy
call costs a fraction of a torch call, and a request's free is ~20 calls either way.

NOTE: the views are taken once and stay valid because the allocator never replaces these
tensors (every write to them is in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dsv4_worker.mem.alloc_config import CLOSED
from dsv4_worker.mem.errors import OwnershipError
from dsv4_worker.mem.held import STALE_MAPPING

if TYPE_CHECKING:
    from dsv4_worker.mem.kv_allocator import KVAllocator


class HostViews(NamedTuple):
    """numpy views of a CPU allocator's request and mapping state."""

    page_table: np.ndarray
    full_to_swa: np.ndarray
    num_tokens: np.ndarray
    swa_start_tokens: np.ndarray
    next_slot: np.ndarray


def host_views(alloc: KVAllocator) -> HostViews:
    return HostViews(
        alloc.page_table.numpy(),
        alloc.full_to_swa.numpy(),
        alloc.num_tokens.numpy(),
        alloc.swa_start_tokens.numpy(),
        alloc.next_slot.numpy(),
    )


def free_one(alloc: KVAllocator, views: HostViews, slot: int) -> None:
    """Free every page of request `slot` (in 1..num_request_slots) and close it; raises
    OwnershipError, changing nothing, on a closed slot, a stale SWA mapping, or a page the
    request does not own or lists twice."""
    page_size = alloc.config.page_size
    num_tokens = int(views.num_tokens[slot])
    if num_tokens < 0:
        raise OwnershipError(f"free: request slot {slot} is not open")
    total = -(-num_tokens // page_size)
    first_swa = min(int(views.swa_start_tokens[slot]) // page_size, total)
    pages = views.page_table[slot, :total]  # a view: cleared last
    mapped = views.full_to_swa.take(pages)
    if first_swa and np.count_nonzero(mapped[:first_swa]):
        raise OwnershipError(STALE_MAPPING)
    swa_pages, swa_owners = mapped[first_swa:], pages[first_swa:]
    # SWA pages each owned by one of the full pages, which the claim proves distinct, are
    # distinct too (and an in-window 0 is refused: unit 0 is never owned). The claim is the
    # only check that writes, so it comes last.
    alloc.swa.check_owners_host(swa_pages, swa_owners)
    alloc.full.claim_host(pages, slot)
    # All checks passed: mutate. The evicted pages' mappings read 0 already (checked above).
    alloc.swa.release_host(swa_pages)
    views.full_to_swa[swa_owners] = 0
    alloc.full.release_host(pages)
    pages[:] = 0
    views.num_tokens[slot] = CLOSED
    views.swa_start_tokens[slot] = 0
    views.next_slot[slot] = 0
