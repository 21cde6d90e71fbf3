"""What requests hold, gathered and checked before a free. Reads a KVAllocator, never writes it.

Raises OwnershipError on a mapping that breaks the window invariant (an SWA page outside the
window, or none inside it: a stale mapping left by an earlier owner). One request's free on the
CPU takes `host_free` instead (the same checks in numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dsv4_worker.mem.errors import OwnershipError
from dsv4_worker.mem.scratch import per_item

if TYPE_CHECKING:
    from dsv4_worker.mem.kv_allocator import KVAllocator

STALE_MAPPING = (
    "free: a full page's SWA mapping disagrees with the request's window "
    "(a stale mapping left by an earlier owner?)"
)


class Held(NamedTuple):
    """Pages a batch of requests holds."""

    pages: Tensor  # full pages
    owners: Tensor  # request slot of each full page
    swa_pages: Tensor  # mapped SWA pages
    swa_owners: Tensor  # full page of each SWA page
    table_index: Tensor  # flat page-table index of `pages`


def held_by_batch(alloc: KVAllocator, slots: Tensor, num_tokens: Tensor) -> Held:
    """The pages of open requests `slots` holding `num_tokens` tokens each."""
    math = alloc.page_math
    counts = math.pages_for(num_tokens)
    total = int(counts.sum())
    batch, cols = alloc.scratch.runs(counts, total)
    rows = per_item(slots, batch).expand(total)
    flat = torch.add(cols, rows, alpha=alloc.config.max_pages_per_request)
    pages = alloc.table_flat.index_select(0, flat)
    mapped = alloc.full_to_swa.index_select(0, pages)
    swa_cols = math.div(alloc.swa_start_tokens.index_select(0, slots))
    in_window = cols >= per_item(swa_cols, batch)
    if not torch.equal(mapped > 0, in_window):
        raise OwnershipError(STALE_MAPPING)
    swa_pages, swa_owners = mapped.masked_select(in_window), pages.masked_select(in_window)
    return Held(pages, rows, swa_pages, swa_owners, flat)
