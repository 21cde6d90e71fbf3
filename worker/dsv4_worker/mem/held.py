"""What requests hold, gathered and checked before a free. Reads a KVAllocator's host tables,
never writes them (numpy: no device data is read).

Raises OwnershipError on a mapping that breaks the window invariant (an SWA page outside the
window, or none inside it: a stale mapping left by an earlier owner).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dsv4_worker.mem.errors import OwnershipError
from dsv4_worker.mem.runs import pages_for, per_item, runs

if TYPE_CHECKING:
    from dsv4_worker.mem.kv_allocator import KVAllocator

STALE_MAPPING = (
    "free: a full page's SWA mapping disagrees with the request's window "
    "(a stale mapping left by an earlier owner?)"
)


class Held(NamedTuple):
    """Pages a batch of requests holds (int64 host arrays)."""

    pages: np.ndarray  # full pages
    owners: np.ndarray  # request slot of each full page (one entry: every page's)
    swa_pages: np.ndarray  # mapped SWA pages
    swa_owners: np.ndarray  # full page of each SWA page
    table_index: np.ndarray  # flat page-table index of `pages`


def held_by_batch(alloc: KVAllocator, slots: np.ndarray, num_tokens: np.ndarray) -> Held:
    """The pages of open requests `slots` holding `num_tokens` tokens each."""
    page, host = alloc.config.page_size, alloc.host
    counts = pages_for(num_tokens, page)
    batch, cols = runs(counts, int(counts.sum()))
    rows = per_item(slots, batch)
    flat = cols + rows * alloc.config.max_pages_per_request
    pages = host.page_table.reshape(-1)[flat]
    mapped = host.full_to_swa[pages]
    in_window = cols >= per_item(host.swa_start_tokens[slots] // page, batch)
    if np.count_nonzero((mapped > 0) != in_window):
        raise OwnershipError(STALE_MAPPING)
    return Held(pages, rows, mapped[in_window], pages[in_window], flat)
