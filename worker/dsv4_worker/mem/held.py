"""What requests hold, gathered and checked before a free. Reads a KVAllocator, never writes it.

Both gatherers raise OwnershipError on a mapping that breaks the window invariant (an SWA page
outside the window, or none inside it: a stale mapping left by an earlier owner).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dsv4_worker.mem.errors import OwnershipError
from dsv4_worker.mem.scratch import per_item

if TYPE_CHECKING:
    from dsv4_worker.mem.kv_allocator import KVAllocator

_STALE = (
    "free: a full page's SWA mapping disagrees with the request's window "
    "(a stale mapping left by an earlier owner?)"
)


class Held(NamedTuple):
    """Pages a batch of requests holds."""

    pages: Tensor  # full pages
    owners: Tensor  # request slot of each full page
    swa_pages: Tensor  # mapped SWA pages
    swa_owners: Tensor  # full page of each SWA page
    table_index: Tensor | None  # flat page-table index of `pages` (None: `pages` is a view)


def held_by_one(alloc: KVAllocator, slots: Tensor, slot: int) -> Held:
    """The pages of one request (`slots` holds the one valid `slot`); `pages` is a view of its
    page-table row. Raises on a closed slot."""
    p_size = alloc.config.page_size
    num_tokens = int(alloc.num_tokens[slot])
    if num_tokens < 0:
        raise OwnershipError(f"free: request slot {slot} is not open")
    total = -(-num_tokens // p_size)
    first_swa = min(int(alloc.swa_start_tokens[slot]) // p_size, total)
    pages = alloc.page_table[slot][:total]
    mapped = alloc.full_to_swa.index_select(0, pages)
    swa_pages = mapped[first_swa:]
    if int(torch.count_nonzero(mapped[:first_swa])) or (
        swa_pages.numel() and int(swa_pages.min()) < 1
    ):
        raise OwnershipError(_STALE)
    return Held(pages, slots.expand(total), swa_pages, pages[first_swa:], None)


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
        raise OwnershipError(_STALE)
    swa_pages, swa_owners = mapped.masked_select(in_window), pages.masked_select(in_window)
    return Held(pages, rows, swa_pages, swa_owners, flat)
