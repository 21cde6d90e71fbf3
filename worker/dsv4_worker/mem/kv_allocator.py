"""KVAllocator: full (virtual) pages, physical SWA pages and the full->SWA page mapping.

Indices only (bytes live in `KVPool`). Per request slot r, P = page_size:

    num_tokens[r]          tokens holding a full slot; -1 = slot closed
    page_table[r, c]       full page of positions [c*P, (c+1)*P); 0 = none
    swa_start_tokens[r]    page-aligned; page columns c < swa_start/P have no SWA page
    full_to_swa[f]         SWA page of full page f; 0 = none (compressed pools use f itself)

NOTE (window invariant, checked by `check_integrity`): for an open request, a column
c < ceil(n/P) has an SWA page iff c >= swa_start/P, and swa_start <= window_floor(n), where
window_floor(n) = floor_to_page(max(0, n - window - draft)). Tokens in [n - window - draft, n)
therefore always keep SWA rows; eviction raises swa_start to window_floor(n).
NOTE: every batch operation validates before its first write (all-or-nothing), and every free
checks ownership on both pools (a double free or a stale mapping raises OwnershipError).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_worker.mem.alloc_config import CLOSED, AllocatorConfig
from dsv4_worker.mem.errors import OutOfPages, OwnershipError, RequestTooLong
from dsv4_worker.mem.integrity import check_kv_allocator
from dsv4_worker.mem.page_allocator import PageAllocator
from dsv4_worker.mem.usage import PoolUsage

_STALE = (
    "free: a full page's SWA mapping disagrees with the request's window "
    "(a stale mapping left by an earlier owner?)"
)


class _Held(NamedTuple):
    """Pages a batch of requests holds, gathered and checked before a free."""

    pages: Tensor  # full pages
    owners: Tensor  # request slot of each full page
    swa_pages: Tensor  # mapped SWA pages
    swa_owners: Tensor  # full page of each SWA page
    table_index: Tensor | None  # flat page-table index of `pages` (None: `pages` is a view)


class KVAllocator:
    def __init__(self, config: AllocatorConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        dev, i64 = self.device, torch.int64
        self.full = PageAllocator("full", config.num_full_pages, dev)
        self.swa = PageAllocator("swa", config.num_swa_pages, dev)
        self.full_to_swa = torch.zeros(config.num_full_pages + 1, dtype=i64, device=dev)
        slots, cols = config.num_request_slots + 1, config.max_pages_per_request
        self.page_table = torch.zeros(slots, cols, dtype=i64, device=dev)
        self._table_flat = self.page_table.view(-1)  # index = slot * cols + column
        self.num_tokens = torch.full((slots,), CLOSED, dtype=i64, device=dev)
        self.swa_start_tokens = torch.zeros(slots, dtype=i64, device=dev)
        self._slot_tag = torch.zeros(slots, dtype=i64, device=dev)  # duplicate detection scratch
        self._iota_cache = torch.arange(max(slots, 1024), dtype=i64, device=dev)
        self._ones_cache = torch.ones(max(slots, 1024), dtype=i64, device=dev)
        page = config.page_size
        self._shift = page.bit_length() - 1 if page & (page - 1) == 0 else -1

    # -- queries ---------------------------------------------------------------------------------

    def window_floor(self, num_tokens: Tensor) -> Tensor:
        """Page-aligned token count below which no SWA row is needed any more."""
        keep = self.config.retained_tokens
        return self._floor_page(torch.clamp(num_tokens - keep, min=0))

    def open_slots(self) -> Tensor:
        return (self.num_tokens >= 0).nonzero().squeeze(1)

    def request_pages(self, slot: int) -> tuple[Tensor, Tensor]:
        """(full page per column, its SWA page or 0) of one open request."""
        n = int(self.num_tokens[slot])
        if n < 0:
            raise OwnershipError(f"request slot {slot} is not open")
        full = self.page_table[slot, : pages_for_tokens(n, self.config.page_size)].clone()
        return full, self.full_to_swa[full]

    def usage(self) -> tuple[PoolUsage, PoolUsage]:
        return self.full.usage(), self.swa.usage()

    def check_integrity(self) -> None:
        check_kv_allocator(self)

    # -- request lifecycle -----------------------------------------------------------------------

    def open(self, slots: Tensor) -> None:
        """Start tracking fresh request slots (0 tokens)."""
        if slots.numel() == 0:
            return
        n = self.num_tokens.index_select(0, slots)
        if not self._unique(slots) or int(n.max()) != CLOSED:
            raise OwnershipError("open: a request slot is already open or repeated in the batch")
        self.num_tokens.index_fill_(0, slots, 0)
        self.swa_start_tokens.index_fill_(0, slots, 0)

    def free(self, slots: Tensor) -> None:
        """Free every full and SWA page of the requests and close their slots."""
        if slots.numel() == 0:
            return
        if slots.numel() == 1:
            held = self._held_one(slots)
        else:
            held = self._held(slots, self._checked_num_tokens(slots))
        owners = self.full.claim(held.pages, held.owners)
        try:
            self.swa.claim(held.swa_pages, held.swa_owners)
        except OwnershipError:
            self.full.unclaim(held.pages, owners)
            raise
        # All checks passed: mutate (the table entries last: `pages` may be a view of them).
        self.swa.release_claimed(held.swa_pages)
        self.full_to_swa.index_fill_(0, held.pages, 0)
        self.full.release_claimed(held.pages)
        if held.table_index is None:
            held.pages.fill_(0)
        else:
            self._table_flat.index_fill_(0, held.table_index, 0)
        self.num_tokens.index_fill_(0, slots, CLOSED)
        self.swa_start_tokens.index_fill_(0, slots, 0)

    def _held_one(self, slots: Tensor) -> _Held:
        """The pages one request holds (`pages` is a view of its page-table row); raises on a
        closed slot or on a mapping that breaks the window invariant (a stale mapping)."""
        slot, p_size = int(slots), self.config.page_size  # int(): a one-element tensor
        num_tokens = int(self.num_tokens[slot])
        if num_tokens < 0:
            raise OwnershipError(f"request slot {slot} is not open")
        total = pages_for_tokens(num_tokens, p_size)
        first_swa = min(int(self.swa_start_tokens[slot]) // p_size, total)
        pages = self.page_table[slot][:total]
        mapped = self.full_to_swa.index_select(0, pages)
        swa_pages = mapped[first_swa:]
        if int(torch.count_nonzero(mapped[:first_swa])) or (
            swa_pages.numel() and int(swa_pages.min()) < 1
        ):
            raise OwnershipError(_STALE)
        return _Held(pages, slots.expand(total), swa_pages, pages[first_swa:], None)

    def _held(self, slots: Tensor, n: Tensor) -> _Held:
        counts = self._pages_for(n)
        total = int(counts.sum())
        batch, cols = self._runs(counts, total)
        rows = slots.index_select(0, batch)
        flat = torch.add(cols, rows, alpha=self.config.max_pages_per_request)
        pages = self._table_flat.index_select(0, flat)
        mapped = self.full_to_swa.index_select(0, pages)
        swa_cols = self._div_page(self.swa_start_tokens.index_select(0, slots))
        in_window = cols >= swa_cols.index_select(0, batch)
        if not torch.equal(mapped > 0, in_window):
            raise OwnershipError(_STALE)
        swa_pages, swa_owners = mapped.masked_select(in_window), pages.masked_select(in_window)
        return _Held(pages, rows, swa_pages, swa_owners, flat)

    # -- allocation ------------------------------------------------------------------------------

    def extend(self, slots: Tensor, num_new_tokens: Tensor) -> Tensor:
        """Grow each request by `num_new_tokens[i]` (prefill chunk); returns the new tokens' full
        slots, request-major. Every new page gets an SWA page (the chunk is written in full)."""
        if num_new_tokens.shape != slots.shape:
            raise ValueError("extend: one num_new_tokens entry per request slot")
        if slots.numel() == 0:
            return slots.clone()
        n0 = self._checked_num_tokens(slots)
        n1 = n0 + num_new_tokens
        p0 = self._pages_for(n0)
        counts = self._pages_for(n1) - p0
        if int(num_new_tokens.min()) < 0:
            raise ValueError("extend: num_new_tokens must be >= 0")
        if int(n1.max()) > self.config.max_tokens_per_request:
            raise RequestTooLong(
                f"extend: a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        total_pages = int(counts.sum())
        self._check_free(total_pages, total_pages)
        if total_pages:
            self._alloc_columns(slots, p0, counts, total_pages, None)
        self.num_tokens.index_copy_(0, slots, n1)
        return self._token_slots(slots, n0, num_new_tokens)

    def decode(self, slots: Tensor) -> Tensor:
        """One more token per request; a page (and its SWA page) only at a page boundary.
        Returns each request's new full slot."""
        if slots.numel() == 0:
            return slots.clone()
        n0 = self._checked_num_tokens(slots, max_tokens=self.config.max_tokens_per_request - 1)
        offsets, cols = self._mod_page(n0), self._div_page(n0)
        flat = torch.add(cols, slots, alpha=self.config.max_pages_per_request)
        rollover = offsets == 0  # requests whose next token starts a new page
        new_slots = slots.masked_select(rollover)
        num_new = new_slots.numel()
        if num_new:
            self._check_free(num_new, num_new)
            pages = self.full.pop(new_slots)
            self._table_flat.index_copy_(0, flat.masked_select(rollover), pages)
            self.full_to_swa.index_copy_(0, pages, self.swa.pop(pages))
        out = torch.add(
            offsets, self._table_flat.index_select(0, flat), alpha=self.config.page_size
        )
        self.num_tokens.index_add_(0, slots, self._ones(slots.numel()))
        return out

    def alloc_tail(self, slots: Tensor, num_tokens: Tensor) -> None:
        """PD decode preallocation for fresh requests: full pages for all `num_tokens`, SWA pages
        only for the page-floored window tail [window_floor(n), n)."""
        self.alloc_sparse(slots, num_tokens, self.window_floor(num_tokens))

    def alloc_sparse(self, slots: Tensor, num_tokens: Tensor, swa_start_tokens: Tensor) -> None:
        """Allocate fresh requests (0 tokens) to `num_tokens`, with SWA pages only for columns
        >= swa_start/P (page-aligned, <= window_floor(n)). Used by PD preallocation and reload.

        NOTE (#25805): every mapping entry of the new full pages is written, the non-tail ones
        with 0, so a recycled page can never carry a previous owner's SWA page."""
        if not slots.shape == num_tokens.shape == swa_start_tokens.shape:
            raise ValueError("alloc_sparse: one num_tokens / swa_start entry per request slot")
        if slots.numel() == 0:
            return
        n0 = self._checked_num_tokens(slots)
        p1 = self._pages_for(num_tokens)
        start_cols = self._div_page(swa_start_tokens)
        if int(torch.count_nonzero(n0)):
            raise OwnershipError("alloc_sparse: every request must be open and still empty")
        if int(num_tokens.max()) > self.config.max_tokens_per_request:
            raise RequestTooLong(
                f"alloc_sparse: a request exceeds {self.config.max_tokens_per_request} tokens"
            )
        invalid = (
            (num_tokens < 0)
            | (self._mod_page(swa_start_tokens) != 0)
            | (swa_start_tokens < 0)
            | (swa_start_tokens > self.window_floor(num_tokens))
        )
        if bool(invalid.any()):
            raise ValueError(
                "alloc_sparse: num_tokens must be >= 0 and swa_start_tokens page-aligned, "
                ">= 0 and <= window_floor(num_tokens)"
            )
        total_full, total_swa = int(p1.sum()), int((p1 - start_cols).clamp(min=0).sum())
        self._check_free(total_full, total_swa)
        if total_full:
            self._alloc_columns(slots, torch.zeros_like(p1), p1, total_full, start_cols)
        self.num_tokens.index_copy_(0, slots, num_tokens)
        self.swa_start_tokens.index_copy_(0, slots, swa_start_tokens)

    def evict_window(self, slots: Tensor | None = None) -> int:
        """Free the SWA pages that slid out of the window (all open requests by default).
        Returns the number of SWA pages freed; never frees a page holding an in-window token."""
        if slots is None:
            slots = self.open_slots()
            if slots.numel() == 0:
                return 0
            n = self.num_tokens.index_select(0, slots)
        elif slots.numel() == 0:
            return 0
        else:
            n = self._checked_num_tokens(slots)
        start = self.swa_start_tokens.index_select(0, slots)
        target = torch.maximum(self.window_floor(n), start)
        counts = self._div_page(target - start)
        total = int(counts.sum())
        if total == 0:
            return 0
        batch, within = self._runs(counts, total)
        rows = slots.index_select(0, batch)
        cols = self._div_page(start).index_select(0, batch) + within
        pages = self._table_flat.index_select(
            0, torch.add(cols, rows, alpha=self.config.max_pages_per_request)
        )
        swa_pages = self.full_to_swa.index_select(0, pages)
        if int(swa_pages.min()) < 1 or not torch.equal(
            self.full.owner.index_select(0, pages), rows
        ):
            raise OwnershipError("evict_window: an in-window column has no SWA page or owner")
        self.swa.claim(swa_pages, pages)
        self.swa.release_claimed(swa_pages)
        self.full_to_swa.index_fill_(0, pages, 0)
        self.swa_start_tokens.index_copy_(0, slots, target)
        return total

    # -- internals -------------------------------------------------------------------------------

    def _alloc_columns(
        self, slots: Tensor, first_cols: Tensor, counts: Tensor, total: int, swa_from: Tensor | None
    ) -> None:
        """Fill columns [first_cols[i], first_cols[i] + counts[i]) of each request with new full
        pages; map an SWA page to every new page (or to those at columns >= swa_from[i])."""
        batch, within = self._runs(counts, total)
        rows = slots.index_select(0, batch)
        cols = first_cols.index_select(0, batch) + within
        pages = self.full.alloc(rows)
        flat = torch.add(cols, rows, alpha=self.config.max_pages_per_request)
        self._table_flat.index_copy_(0, flat, pages)
        if swa_from is None:
            self.full_to_swa.index_copy_(0, pages, self.swa.alloc(pages))
            return
        self.full_to_swa.index_fill_(0, pages, 0)
        tail = pages[cols >= swa_from.index_select(0, batch)]
        self.full_to_swa.index_copy_(0, tail, self.swa.alloc(tail))

    def _token_slots(self, slots: Tensor, n0: Tensor, num_new: Tensor) -> Tensor:
        total = int(num_new.sum())
        batch, within = self._runs(num_new, total)
        positions = n0.index_select(0, batch) + within
        flat = torch.add(
            self._div_page(positions),
            slots.index_select(0, batch),
            alpha=self.config.max_pages_per_request,
        )
        pages = self._table_flat.index_select(0, flat)
        return self._page_start(pages) + self._mod_page(positions)

    def _runs(self, counts: Tensor, total: int) -> tuple[Tensor, Tensor]:
        """(batch index, index within its run) for runs of `counts`; `total == counts.sum()`."""
        if counts.numel() == 1:
            return torch.zeros(total, dtype=torch.int64, device=self.device), self._iota(total)
        batch = torch.repeat_interleave(counts, output_size=total)
        first = torch.cumsum(counts, 0) - counts
        return batch, self._iota(total) - first.index_select(0, batch)

    def _iota(self, n: int) -> Tensor:
        if n > self._iota_cache.numel():
            self._iota_cache = torch.arange(2 * n, dtype=torch.int64, device=self.device)
        return self._iota_cache[:n]

    def _checked_num_tokens(self, slots: Tensor, max_tokens: int | None = None) -> Tensor:
        """num_tokens of a non-empty batch; raises on a closed or repeated slot, or one holding
        more than `max_tokens` (no writes)."""
        n = self.num_tokens.index_select(0, slots)
        lo, hi = torch.aminmax(n)
        if int(lo) < 0:
            closed = slots[n < 0]
            raise OwnershipError(f"request slot {int(closed[0])} is not open")
        if max_tokens is not None and int(hi) > max_tokens:
            raise RequestTooLong(
                f"a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        if slots.numel() > 1 and not self._unique(slots):
            raise OwnershipError("a request slot appears twice in one batch")
        return n

    def _ones(self, n: int) -> Tensor:
        if n > self._ones_cache.numel():
            self._ones_cache = torch.ones(2 * n, dtype=torch.int64, device=self.device)
        return self._ones_cache[:n]

    def _unique(self, slots: Tensor) -> bool:
        tag = self._iota(slots.numel())
        self._slot_tag.index_copy_(0, slots, tag)
        return torch.equal(self._slot_tag.index_select(0, slots), tag)

    def _check_free(self, full_pages: int, swa_pages: int) -> None:
        if not self.full.can_alloc(full_pages):
            raise OutOfPages("full", full_pages, self.full.num_free)
        if not self.swa.can_alloc(swa_pages):
            raise OutOfPages("swa", swa_pages, self.swa.num_free)

    # Page arithmetic: shifts when page_size is a power of two (the common case), else division.
    def _div_page(self, x: Tensor) -> Tensor:
        if self._shift >= 0:
            return torch.bitwise_right_shift(x, self._shift)
        return torch.div(x, self.config.page_size, rounding_mode="floor")

    def _mod_page(self, x: Tensor) -> Tensor:
        if self._shift >= 0:
            return torch.bitwise_and(x, self.config.page_size - 1)
        return torch.remainder(x, self.config.page_size)

    def _page_start(self, pages: Tensor) -> Tensor:
        if self._shift >= 0:
            return torch.bitwise_left_shift(pages, self._shift)
        return pages * self.config.page_size

    def _floor_page(self, x: Tensor) -> Tensor:
        return x - self._mod_page(x)

    def _pages_for(self, num_tokens: Tensor) -> Tensor:
        return self._div_page(num_tokens + (self.config.page_size - 1))
