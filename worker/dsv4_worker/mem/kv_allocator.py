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
NOTE: every operation validates before its first write (all-or-nothing): arguments first
(`args.py`: any integer dtype, the allocator's device, 1-D, slots in 1..num_request_slots,
counts bounded before any int64 arithmetic), then ownership, length and free pages. Every free
checks ownership on both pools (a double free or a stale mapping raises OwnershipError).
NOTE: `can_extend` / `can_decode` run the same checks as `extend` / `decode` (the `_plan_*`
methods) and return the error as a `Verdict` instead of raising it, so they agree exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from dsv4_worker.mem.alloc_config import CLOSED, AllocatorConfig
from dsv4_worker.mem.args import (
    check_bounds,
    check_range,
    check_same_shape,
    int64_vector,
    int_arg,
    resolve_device,
)
from dsv4_worker.mem.errors import (
    InvalidArgument,
    KVMemoryError,
    OutOfPages,
    OwnershipError,
    RequestTooLong,
    Verdict,
)
from dsv4_worker.mem.held import held_by_batch, held_by_one
from dsv4_worker.mem.integrity import check_kv_allocator
from dsv4_worker.mem.page_allocator import PageAllocator
from dsv4_worker.mem.page_math import PageMath
from dsv4_worker.mem.scratch import BatchScratch
from dsv4_worker.mem.usage import PoolUsage

_YES = Verdict()


class _ExtendPlan(NamedTuple):
    """A checked `extend`: applying it cannot fail."""

    slots: Tensor
    num_new: Tensor
    n0: Tensor  # tokens before
    first_cols: Tensor  # first new page column of each request
    counts: Tensor  # new pages of each request
    total_pages: int


class _DecodePlan(NamedTuple):
    """A checked `decode`: applying it cannot fail."""

    slots: Tensor
    offsets: Tensor  # offset of the new token in its page
    flat: Tensor  # flat page-table index of the new token's column
    rollover: Tensor  # the new token starts a new page
    new_page_slots: Tensor  # slots that need a new page


class KVAllocator:
    def __init__(self, config: AllocatorConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = resolve_device(device)
        dev, i64 = self.device, torch.int64
        self.full = PageAllocator("full", config.num_full_pages, dev)
        self.swa = PageAllocator("swa", config.num_swa_pages, dev)
        self.full_to_swa = torch.zeros(config.num_full_pages + 1, dtype=i64, device=dev)
        slots, cols = config.num_request_slots + 1, config.max_pages_per_request
        self.page_table = torch.zeros(slots, cols, dtype=i64, device=dev)
        self.num_tokens = torch.full((slots,), CLOSED, dtype=i64, device=dev)
        self.swa_start_tokens = torch.zeros(slots, dtype=i64, device=dev)
        # Helpers, not state: a flat view of the page table, page arithmetic, scratch indices.
        self.table_flat = self.page_table.view(-1)  # index = slot * cols + column
        self.page_math = PageMath(config.page_size)
        self.scratch = BatchScratch(slots, dev)

    # -- queries ---------------------------------------------------------------------------------

    def window_floor(self, num_tokens: Tensor) -> Tensor:
        """Page-aligned token count below which no SWA row is needed any more."""
        keep = self.config.retained_tokens
        return self.page_math.floor(num_tokens.clamp(min=keep) - keep)  # no int64 overflow

    def open_slots(self) -> Tensor:
        return (self.num_tokens >= 0).nonzero().squeeze(1)

    def request_pages(self, slot: int) -> tuple[Tensor, Tensor]:
        """(full page per column, its SWA page or 0) of one open request."""
        slot = int_arg(slot, "request_pages: slot", 1, self.config.num_request_slots)
        n = int(self.num_tokens[slot])
        if n < 0:
            raise OwnershipError(f"request slot {slot} is not open")
        full = self.page_table[slot, : -(-n // self.config.page_size)].clone()
        return full, self.full_to_swa[full]

    def can_extend(self, slots: Tensor, num_new_tokens: Tensor) -> Verdict:
        """Whether `extend(slots, num_new_tokens)` would succeed; else the error it would raise."""
        return _verdict(lambda: self._plan_extend(slots, num_new_tokens))

    def can_decode(self, slots: Tensor) -> Verdict:
        """Whether `decode(slots)` would succeed; else the error it would raise."""
        return _verdict(lambda: self._plan_decode(slots))

    def usage(self) -> tuple[PoolUsage, PoolUsage]:
        return self.full.usage(), self.swa.usage()

    def check_integrity(self) -> None:
        check_kv_allocator(self)

    # -- request lifecycle -----------------------------------------------------------------------

    def open(self, slots: Tensor) -> None:
        """Start tracking fresh request slots (0 tokens)."""
        slots = self._slots_arg("open", slots)
        if slots.numel() == 0:
            return
        check_range(slots, 1, self.config.num_request_slots, "open: request slots")
        n = self.num_tokens.index_select(0, slots)
        if not self.scratch.unique(slots) or int(n.max()) != CLOSED:
            raise OwnershipError("open: a request slot is already open or repeated in the batch")
        self.num_tokens.index_fill_(0, slots, 0)
        self.swa_start_tokens.index_fill_(0, slots, 0)

    def free(self, slots: Tensor) -> None:
        """Free every full and SWA page of the requests and close their slots."""
        slots = self._slots_arg("free", slots)
        if slots.numel() == 0:
            return
        if slots.numel() == 1:
            check_range(slots, 1, self.config.num_request_slots, "free: request slots")
            held = held_by_one(self, slots)
        else:
            held = held_by_batch(self, slots, self._checked_num_tokens("free", slots))
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
            self.table_flat.index_fill_(0, held.table_index, 0)
        self.num_tokens.index_fill_(0, slots, CLOSED)
        self.swa_start_tokens.index_fill_(0, slots, 0)

    # -- allocation ------------------------------------------------------------------------------

    def extend(self, slots: Tensor, num_new_tokens: Tensor) -> Tensor:
        """Grow each request by `num_new_tokens[i]` (prefill chunk); returns the new tokens' full
        slots, request-major. Every new page gets an SWA page (the chunk is written in full)."""
        plan = self._plan_extend(slots, num_new_tokens)
        if plan.slots.numel() == 0:
            return plan.slots.clone()
        if plan.total_pages:
            self._alloc_columns(plan.slots, plan.first_cols, plan.counts, plan.total_pages, None)
        self.num_tokens.index_copy_(0, plan.slots, plan.n0 + plan.num_new)
        return self._token_slots(plan.slots, plan.n0, plan.num_new)

    def _plan_extend(self, slots: Tensor, num_new_tokens: Tensor) -> _ExtendPlan:
        slots = self._slots_arg("extend", slots)
        num_new = int64_vector(num_new_tokens, "extend: num_new_tokens", self.device)
        check_same_shape("extend", slots, num_new)
        if slots.numel() == 0:
            return _ExtendPlan(slots, num_new, slots, slots, slots, 0)
        n0 = self._checked_num_tokens("extend", slots)
        # NOTE: bounded against the room left (never n0 + k, which can overflow int64).
        room = self.config.max_tokens_per_request - n0
        lowest, too_long = torch.stack([num_new.min(), (num_new > room).any()]).tolist()
        if lowest < 0:
            raise InvalidArgument(f"extend: num_new_tokens must be >= 0, got {lowest}")
        if too_long:
            raise RequestTooLong(
                f"extend: a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        first_cols = self.page_math.pages_for(n0)
        counts = self.page_math.pages_for(n0 + num_new) - first_cols
        total_pages = int(counts.sum())
        self._check_free(total_pages, total_pages)
        return _ExtendPlan(slots, num_new, n0, first_cols, counts, total_pages)

    def decode(self, slots: Tensor) -> Tensor:
        """One more token per request; a page (and its SWA page) only at a page boundary.
        Returns each request's new full slot."""
        plan = self._plan_decode(slots)
        if plan.slots.numel() == 0:
            return plan.slots.clone()
        if plan.new_page_slots.numel():
            pages = self.full.pop(plan.new_page_slots)
            self.table_flat.index_copy_(0, plan.flat.masked_select(plan.rollover), pages)
            self.full_to_swa.index_copy_(0, pages, self.swa.pop(pages))
        out = torch.add(
            plan.offsets, self.table_flat.index_select(0, plan.flat), alpha=self.config.page_size
        )
        self.num_tokens.index_add_(0, plan.slots, self.scratch.ones(plan.slots.numel()))
        return out

    def _plan_decode(self, slots: Tensor) -> _DecodePlan:
        slots = self._slots_arg("decode", slots)
        if slots.numel() == 0:
            return _DecodePlan(slots, slots, slots, slots, slots)
        max_tokens = self.config.max_tokens_per_request - 1
        n0 = self._checked_num_tokens("decode", slots, max_tokens=max_tokens)
        offsets, cols = self.page_math.mod(n0), self.page_math.div(n0)
        flat = torch.add(cols, slots, alpha=self.config.max_pages_per_request)
        rollover = offsets == 0  # requests whose next token starts a new page
        new_page_slots = slots.masked_select(rollover)
        num_new = new_page_slots.numel()
        self._check_free(num_new, num_new)
        return _DecodePlan(slots, offsets, flat, rollover, new_page_slots)

    def alloc_tail(self, slots: Tensor, num_tokens: Tensor) -> None:
        """PD decode preallocation for fresh requests: full pages for all `num_tokens`, SWA pages
        only for the page-floored window tail [window_floor(n), n)."""
        num_tokens = int64_vector(num_tokens, "alloc_tail: num_tokens", self.device)
        self._alloc_sparse("alloc_tail", slots, num_tokens, self.window_floor(num_tokens))

    def alloc_sparse(self, slots: Tensor, num_tokens: Tensor, swa_start_tokens: Tensor) -> None:
        """Allocate fresh requests (0 tokens) to `num_tokens`, with SWA pages only for columns
        >= swa_start/P (page-aligned, <= window_floor(n)). Used by PD preallocation and reload.

        NOTE (#25805): every mapping entry of the new full pages is written, the non-tail ones
        with 0, so a recycled page can never carry a previous owner's SWA page."""
        self._alloc_sparse("alloc_sparse", slots, num_tokens, swa_start_tokens)

    def _alloc_sparse(
        self, op: str, slots: Tensor, num_tokens: Tensor, swa_start_tokens: Tensor
    ) -> None:
        slots = self._slots_arg(op, slots)
        num_tokens = int64_vector(num_tokens, f"{op}: num_tokens", self.device)
        swa_start = int64_vector(swa_start_tokens, f"{op}: swa_start_tokens", self.device)
        check_same_shape(op, slots, num_tokens, swa_start)
        if slots.numel() == 0:
            return
        n0 = self._checked_num_tokens(op, slots)
        if int(torch.count_nonzero(n0)):
            raise OwnershipError(f"{op}: every request must be open and still empty")
        if int(num_tokens.max()) > self.config.max_tokens_per_request:
            raise RequestTooLong(
                f"{op}: a request exceeds {self.config.max_tokens_per_request} tokens"
            )
        invalid = (
            (num_tokens < 0)
            | (self.page_math.mod(swa_start) != 0)
            | (swa_start < 0)
            | (swa_start > self.window_floor(num_tokens))
        )
        if bool(invalid.any()):
            raise InvalidArgument(
                f"{op}: num_tokens must be >= 0 and swa_start_tokens page-aligned, "
                ">= 0 and <= window_floor(num_tokens)"
            )
        p1 = self.page_math.pages_for(num_tokens)
        start_cols = self.page_math.div(swa_start)
        total_full, total_swa = int(p1.sum()), int((p1 - start_cols).clamp(min=0).sum())
        self._check_free(total_full, total_swa)
        if total_full:
            self._alloc_columns(slots, torch.zeros_like(p1), p1, total_full, start_cols)
        self.num_tokens.index_copy_(0, slots, num_tokens)
        self.swa_start_tokens.index_copy_(0, slots, swa_start)

    def evict_window(self, slots: Tensor | None = None) -> int:
        """Free the SWA pages that slid out of the window (all open requests by default).
        Returns the number of SWA pages freed; never frees a page holding an in-window token."""
        if slots is None:
            slots = self.open_slots()
            if slots.numel() == 0:
                return 0
            n = self.num_tokens.index_select(0, slots)
        else:
            slots = self._slots_arg("evict_window", slots)
            if slots.numel() == 0:
                return 0
            n = self._checked_num_tokens("evict_window", slots)
        start = self.swa_start_tokens.index_select(0, slots)
        target = torch.maximum(self.window_floor(n), start)
        counts = self.page_math.div(target - start)
        total = int(counts.sum())
        if total == 0:
            return 0
        batch, within = self.scratch.runs(counts, total)
        rows = slots.index_select(0, batch)
        cols = self.page_math.div(start).index_select(0, batch) + within
        pages = self.table_flat.index_select(
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
        batch, within = self.scratch.runs(counts, total)
        rows = slots.index_select(0, batch)
        cols = first_cols.index_select(0, batch) + within
        pages = self.full.alloc(rows)
        flat = torch.add(cols, rows, alpha=self.config.max_pages_per_request)
        self.table_flat.index_copy_(0, flat, pages)
        if swa_from is None:
            self.full_to_swa.index_copy_(0, pages, self.swa.alloc(pages))
            return
        self.full_to_swa.index_fill_(0, pages, 0)
        tail = pages[cols >= swa_from.index_select(0, batch)]
        self.full_to_swa.index_copy_(0, tail, self.swa.alloc(tail))

    def _token_slots(self, slots: Tensor, n0: Tensor, num_new: Tensor) -> Tensor:
        total = int(num_new.sum())
        batch, within = self.scratch.runs(num_new, total)
        positions = n0.index_select(0, batch) + within
        flat = torch.add(
            self.page_math.div(positions),
            slots.index_select(0, batch),
            alpha=self.config.max_pages_per_request,
        )
        pages = self.table_flat.index_select(0, flat)
        return self.page_math.start(pages) + self.page_math.mod(positions)

    def _slots_arg(self, op: str, slots: Tensor) -> Tensor:
        """`slots` as a 1-D int64 tensor (metadata checks only: ranges need a device sync)."""
        return int64_vector(slots, f"{op}: slots", self.device)

    def _checked_num_tokens(self, op: str, slots: Tensor, max_tokens: int | None = None) -> Tensor:
        """num_tokens of a non-empty batch; raises on a slot outside 1..num_request_slots (0 is
        reserved), a closed or repeated slot, or one holding more than `max_tokens` (no writes).
        The range and token checks share one device sync."""
        limit = self.config.num_request_slots
        n = self.num_tokens.index_select(0, slots.clamp(1, limit))  # clamped: never out of range
        s_lo, s_hi, lo, hi = torch.stack([*torch.aminmax(slots), *torch.aminmax(n)]).tolist()
        check_bounds(s_lo, s_hi, 1, limit, f"{op}: request slots")
        if lo < 0:
            closed = slots[n < 0]
            raise OwnershipError(f"{op}: request slot {int(closed[0])} is not open")
        if max_tokens is not None and hi > max_tokens:
            raise RequestTooLong(
                f"{op}: a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        if slots.numel() > 1 and not self.scratch.unique(slots):
            raise OwnershipError(f"{op}: a request slot appears twice in one batch")
        return n

    def _check_free(self, full_pages: int, swa_pages: int) -> None:
        if not self.full.can_alloc(full_pages):
            raise OutOfPages("full", full_pages, self.full.num_free)
        if not self.swa.can_alloc(swa_pages):
            raise OutOfPages("swa", swa_pages, self.swa.num_free)


def _verdict(plan: Callable[[], object]) -> Verdict:
    try:
        plan()
    except KVMemoryError as err:
        return Verdict(err)
    return _YES
