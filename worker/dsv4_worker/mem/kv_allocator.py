"""KVAllocator: full (virtual) pages, physical SWA pages and the full->SWA page mapping.

Indices only (bytes live in `KVPool`). Per request slot r, P = page_size:

    num_tokens[r]          tokens holding a full slot; -1 = slot closed
    page_table[r, c]       full page of positions [c*P, (c+1)*P); 0 = none
    swa_start_tokens[r]    page-aligned; page columns c < swa_start/P have no SWA page
    full_to_swa[f]         SWA page of full page f; 0 = none (compressed pools use f itself)
    next_slot[r]           full slot of the next token, page_table[r, n//P] * P + n % P when
                           n % P != 0; otherwise only = n (mod P); 0 for a closed slot

NOTE (window invariant, checked by `check_integrity`): for an open request, a column
c < ceil(n/P) has an SWA page iff c >= swa_start/P, and swa_start <= window_floor(n), where
window_floor(n) = floor_to_page(max(0, n - window - draft)). Tokens in [n - window - draft, n)
therefore always keep SWA rows; eviction raises swa_start to window_floor(n).
NOTE: every operation validates before its first write (all-or-nothing): arguments first
(`args.py`: any integer dtype, the allocator's device, 1-D, slots in 1..num_request_slots,
counts bounded before any int64 arithmetic), then ownership, length and free pages. Every free
checks ownership on both pools (a double free or a stale mapping raises OwnershipError).
NOTE (validated once): the public methods are the boundary. They check their arguments once and
call the internals, which trust them (no second conversion, range check or tensor per call).
`decode`'s common step, where no request crosses a page, reads `next_slot` only: a slot at a
page boundary, closed, reserved or full reads 0 (mod P) there and takes the checked path, so the
steady step needs no separate open / length check.
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
    IntegrityError,
    InvalidArgument,
    KVMemoryError,
    OutOfPages,
    OwnershipError,
    RequestTooLong,
    Verdict,
)
from dsv4_worker.mem.held import held_by_batch
from dsv4_worker.mem.host_free import free_one, host_views
from dsv4_worker.mem.integrity import check_kv_allocator
from dsv4_worker.mem.page_allocator import PageAllocator
from dsv4_worker.mem.page_math import PageMath
from dsv4_worker.mem.reads import max_of, min_max, min_of, sum_of
from dsv4_worker.mem.scratch import BatchScratch, per_item
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
    loc: Tensor  # each request's next slot (a rollover's is replaced by its new page's first)
    rollover: Tensor | None  # positions in `slots` whose token starts a page; None: none does
    new_page_slots: Tensor  # slots that need a new page
    new_page_flat: Tensor  # flat page-table index of their new columns


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
        self.next_slot = torch.zeros(slots, dtype=i64, device=dev)  # a cache of the two above
        # Helpers, not state: a flat view of the page table, page arithmetic, scratch indices.
        self.table_flat = self.page_table.view(-1)  # index = slot * cols + column
        self.page_math = PageMath(config.page_size)
        self.scratch = BatchScratch(slots, dev)
        # CPU: reading a scalar costs no device sync, and gathers check their own bounds.
        self._host = self.device.type == "cpu"
        # NOTE: one request's free on the CPU runs in numpy over views of this state.
        self._host_views = host_views(self) if self._host else None

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
        self._check_slot_range("open", slots)
        n = self.num_tokens.index_select(0, slots)
        if not self.scratch.unique(slots) or max_of(n) != CLOSED:
            raise OwnershipError("open: a request slot is already open or repeated in the batch")
        self.num_tokens.index_fill_(0, slots, 0)
        self.swa_start_tokens.index_fill_(0, slots, 0)
        self.next_slot.index_fill_(0, slots, 0)

    def free(self, slots: Tensor) -> None:
        """Free every full and SWA page of the requests and close their slots."""
        slots = self._slots_arg("free", slots)
        if slots.numel():
            self.free_checked(slots)

    def free_checked(self, slots: Tensor) -> None:
        """`free` of a non-empty int64 vector on this device (the boundary checked its type);
        ranges, ownership and repeats are still checked here."""
        if slots.numel() == 1 and self._host_views is not None:
            slot = int(slots)
            check_bounds(slot, slot, 1, self.config.num_request_slots, "free: request slots")
            free_one(self, self._host_views, slot)
            return
        held = held_by_batch(self, slots, self._checked_num_tokens("free", slots))
        # NOTE: the claim proves the full pages distinct, so SWA pages each owned by one of
        # them are distinct too: their pool checks owners only.
        claimed = self.full.claim(held.pages, held.owners)
        try:
            self.swa.check_owners(held.swa_pages, held.swa_owners)
        except OwnershipError:
            self.full.unclaim(held.pages, claimed)
            raise
        # All checks passed: mutate. Only the mapped pages' entries are cleared: the others
        # read 0 (`held_by_batch` checks).
        self.swa.release_owned(held.swa_pages)
        self.full_to_swa.index_fill_(0, held.swa_owners, 0)
        self.full.release_claimed(held.pages)
        self.table_flat.index_fill_(0, held.table_index, 0)
        self.num_tokens.index_fill_(0, slots, CLOSED)
        self.swa_start_tokens.index_fill_(0, slots, 0)
        self.next_slot.index_fill_(0, slots, 0)

    # -- allocation ------------------------------------------------------------------------------

    def extend(self, slots: Tensor, num_new_tokens: Tensor) -> Tensor:
        """Grow each request by `num_new_tokens[i]` (prefill chunk); returns the new tokens' full
        slots, request-major. Every new page gets an SWA page (the chunk is written in full)."""
        plan = self._plan_extend(slots, num_new_tokens)
        if plan.slots.numel() == 0:
            return plan.slots.clone()
        if plan.total_pages:
            self._alloc_columns(plan.slots, plan.first_cols, plan.counts, plan.total_pages, None)
        n1 = plan.n0 + plan.num_new
        self.num_tokens.index_copy_(0, plan.slots, n1)
        self._refresh_next_slot(plan.slots, n1)
        return self._token_slots(plan.slots, plan.n0, plan.num_new)

    def _plan_extend(self, slots: Tensor, num_new_tokens: Tensor) -> _ExtendPlan:
        slots = self._slots_arg("extend", slots)
        num_new = int64_vector(num_new_tokens, "extend: num_new_tokens", self.device)
        if num_new.shape != slots.shape:
            check_same_shape("extend", slots, num_new)
        if slots.numel() == 0:
            return _ExtendPlan(slots, num_new, slots, slots, slots, 0)
        n0 = self._checked_num_tokens("extend", slots)
        # NOTE: bounded against the room left (never n0 + k, which can overflow int64).
        room = self.config.max_tokens_per_request - n0
        if self._host:
            lowest, too_long = min_of(num_new), max_of(num_new - room) > 0
        else:
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
        ones = self.scratch.ones(plan.slots.numel())
        if plan.rollover is None:  # the steady step: every next slot is in a page held already
            self.num_tokens.index_add_(0, plan.slots, ones)
            self.next_slot.index_add_(0, plan.slots, ones)
            return plan.loc
        out = plan.loc
        pages = self.full.pop(plan.new_page_slots)
        # NOTE: a column past a request's pages and a free page's mapping are 0: adding writes.
        self.table_flat.index_add_(0, plan.new_page_flat, pages)
        self.full_to_swa.index_add_(0, pages, self.swa.pop(pages))
        out.scatter_(0, plan.rollover, self.page_math.start(pages))
        self.num_tokens.index_add_(0, plan.slots, ones)
        self.next_slot.scatter_(0, plan.slots, torch.add(out, ones))
        return out

    def _plan_decode(self, slots: Tensor) -> _DecodePlan:
        """Checks `decode(slots)` and finds its new pages. Only the requests at a page boundary
        are looked up in `num_tokens`: a next slot inside a page proves its request open, in
        range and below its last column. Anything odd takes `_checked_num_tokens`, which raises
        the precise error."""
        slots = self._slots_arg("decode", slots)
        if slots.numel() == 0:
            return _DecodePlan(slots, slots, None, slots, slots)
        gathered = self._gather_next_slots(slots)
        if gathered is not None:
            loc, offsets, lowest = gathered
            if lowest > 0:  # nobody crosses a page: the steady step
                self._check_unique("decode", slots)
                return _DecodePlan(slots, loc, None, slots, slots)
            rollover = (offsets == 0).nonzero().view(-1)
            boundary = slots.index_select(0, rollover)
            n0 = self.num_tokens.index_select(0, boundary)
            lo, hi = min_max(n0)
            if lo >= 0 and hi < self.config.max_tokens_per_request:  # open (slot 0 reads -1)
                self._check_unique("decode", slots)
                num_new = boundary.numel()
                self._check_free(num_new, num_new)
                cols = self.page_math.div(n0)
                flat = torch.add(cols, boundary, alpha=self.config.max_pages_per_request)
                return _DecodePlan(slots, loc, rollover, boundary, flat)
        max_tokens = self.config.max_tokens_per_request - 1
        self._checked_num_tokens("decode", slots, max_tokens=max_tokens)  # raises
        raise IntegrityError("decode: next_slot disagrees with num_tokens")

    def _gather_next_slots(self, slots: Tensor) -> tuple[Tensor, Tensor, int] | None:
        """(next slot, its offset in its page, the lowest offset) of a non-empty batch, or None
        when a slot is out of range. Closed, reserved and full slots read offset 0."""
        if self._host:
            try:  # the gather checks its bounds: an out-of-range slot raises, reading nothing
                loc = self.next_slot.index_select(0, slots)
            except IndexError:
                return None
            offsets = self.page_math.mod(loc)
            return loc, offsets, min_of(offsets)
        limit = self.config.num_request_slots
        loc = self.next_slot.index_select(0, slots.clamp(0, limit))  # clamped: in range
        offsets = self.page_math.mod(loc)
        s_lo, s_hi, lowest = torch.stack([*torch.aminmax(slots), offsets.min()]).tolist()
        return (loc, offsets, lowest) if s_lo >= 0 and s_hi <= limit else None

    def alloc_tail(self, slots: Tensor, num_tokens: Tensor) -> None:
        """PD decode preallocation for fresh requests: full pages for all `num_tokens`, SWA pages
        only for the page-floored window tail [window_floor(n), n)."""
        slots = self._slots_arg("alloc_tail", slots)
        num_tokens = int64_vector(num_tokens, "alloc_tail: num_tokens", self.device)
        self._alloc_sparse("alloc_tail", slots, num_tokens, None)

    def alloc_sparse(self, slots: Tensor, num_tokens: Tensor, swa_start_tokens: Tensor) -> None:
        """Allocate fresh requests (0 tokens) to `num_tokens`, with SWA pages only for columns
        >= swa_start/P (page-aligned, <= window_floor(n)). Used by PD preallocation and reload.

        NOTE (#25805): every mapping entry of the new full pages is written, the non-tail ones
        with 0, so a recycled page can never carry a previous owner's SWA page."""
        op = "alloc_sparse"
        slots = self._slots_arg(op, slots)
        num_tokens = int64_vector(num_tokens, f"{op}: num_tokens", self.device)
        swa_start = int64_vector(swa_start_tokens, f"{op}: swa_start_tokens", self.device)
        self._alloc_sparse(op, slots, num_tokens, swa_start)

    def _alloc_sparse(
        self, op: str, slots: Tensor, num_tokens: Tensor, swa_start: Tensor | None
    ) -> None:
        """Checked arguments in; `swa_start` None: the window tail (`window_floor`)."""
        if swa_start is None:
            check_same_shape(op, slots, num_tokens)
        else:
            check_same_shape(op, slots, num_tokens, swa_start)
        if slots.numel() == 0:
            return
        n0 = self._checked_num_tokens(op, slots)
        if int(torch.count_nonzero(n0)):
            raise OwnershipError(f"{op}: every request must be open and still empty")
        if max_of(num_tokens) > self.config.max_tokens_per_request:
            raise RequestTooLong(
                f"{op}: a request exceeds {self.config.max_tokens_per_request} tokens"
            )
        floor = self.window_floor(num_tokens)
        if swa_start is None:
            if min_of(num_tokens) < 0:
                raise InvalidArgument(f"{op}: num_tokens must be >= 0")
            swa_start = floor
        elif bool(
            (
                (num_tokens < 0)
                | (self.page_math.mod(swa_start) != 0)
                | (swa_start < 0)
                | (swa_start > floor)
            ).any()
        ):
            raise InvalidArgument(
                f"{op}: num_tokens must be >= 0 and swa_start_tokens page-aligned, "
                ">= 0 and <= window_floor(num_tokens)"
            )
        p1 = self.page_math.pages_for(num_tokens)
        start_cols = self.page_math.div(swa_start)
        total_full = sum_of(p1)
        total_swa = total_full - sum_of(torch.minimum(start_cols, p1))
        self._check_free(total_full, total_swa)
        if total_full:
            self._alloc_columns(slots, None, p1, total_full, start_cols)
        self.num_tokens.index_copy_(0, slots, num_tokens)
        self.swa_start_tokens.index_copy_(0, slots, swa_start)
        self._refresh_next_slot(slots, num_tokens)

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
        total = sum_of(counts)
        if total == 0:
            return 0
        batch, within = self.scratch.runs(counts, total)
        rows = per_item(slots, batch)
        cols = per_item(self.page_math.div(start), batch) + within
        pages = self.table_flat.index_select(
            0, torch.add(cols, rows, alpha=self.config.max_pages_per_request)
        )
        swa_pages = self.full_to_swa.index_select(0, pages)
        if min_of(swa_pages) < 1 or not torch.equal(
            self.full.owner.index_select(0, pages), rows.expand(total)
        ):
            raise OwnershipError("evict_window: an in-window column has no SWA page or owner")
        self.swa.claim(swa_pages, pages)
        self.swa.release_claimed(swa_pages)
        self.full_to_swa.index_fill_(0, pages, 0)
        self.swa_start_tokens.index_copy_(0, slots, target)
        return total

    # -- internals -------------------------------------------------------------------------------

    def _alloc_columns(
        self,
        slots: Tensor,
        first_cols: Tensor | None,
        counts: Tensor,
        total: int,
        swa_from: Tensor | None,
    ) -> None:
        """Fill columns [first_cols[i], first_cols[i] + counts[i]) of each request with new full
        pages (None: from column 0); map an SWA page to every new page (or to those at columns
        >= swa_from[i])."""
        batch, within = self.scratch.runs(counts, total)
        rows = per_item(slots, batch)
        cols = within if first_cols is None else per_item(first_cols, batch) + within
        pages = self.full.pop(rows.expand(total)).clone()  # clone: frees reuse the free list
        flat = torch.add(cols, rows, alpha=self.config.max_pages_per_request)
        self.table_flat.index_copy_(0, flat, pages)
        if swa_from is None:
            self.full_to_swa.index_copy_(0, pages, self.swa.pop(pages))
            return
        self.full_to_swa.index_fill_(0, pages, 0)
        tail = pages.masked_select(cols >= per_item(swa_from, batch))
        self.full_to_swa.index_copy_(0, tail, self.swa.pop(tail))

    def _token_slots(self, slots: Tensor, n0: Tensor, num_new: Tensor) -> Tensor:
        total = sum_of(num_new)
        batch, within = self.scratch.runs(num_new, total)
        positions = per_item(n0, batch) + within
        flat = torch.add(
            self.page_math.div(positions),
            per_item(slots, batch),
            alpha=self.config.max_pages_per_request,
        )
        pages = self.table_flat.index_select(0, flat)
        return torch.add(self.page_math.mod(positions), pages, alpha=self.config.page_size)

    def _refresh_next_slot(self, slots: Tensor, num_tokens: Tensor) -> None:
        """next_slot of requests now holding `num_tokens` (see the table at the top)."""
        cols = self.page_math.div(num_tokens).clamp_(max=self.config.max_pages_per_request - 1)
        pages = self.table_flat.index_select(
            0, torch.add(cols, slots, alpha=self.config.max_pages_per_request)
        )
        nxt = torch.add(self.page_math.mod(num_tokens), pages, alpha=self.config.page_size)
        self.next_slot.index_copy_(0, slots, nxt)

    def _slots_arg(self, op: str, slots: Tensor) -> Tensor:
        """`slots` as a 1-D int64 tensor (metadata checks only: ranges need a device sync)."""
        return int64_vector(slots, f"{op}: slots", self.device)

    def _check_slot_range(self, op: str, slots: Tensor) -> None:
        check_range(slots, 1, self.config.num_request_slots, f"{op}: request slots")

    def _checked_num_tokens(self, op: str, slots: Tensor, max_tokens: int | None = None) -> Tensor:
        """num_tokens of a non-empty batch; raises on a slot outside 1..num_request_slots (0 is
        reserved), a closed or repeated slot, or one holding more than `max_tokens` (no writes).
        Off the CPU the range and token checks share one device sync."""
        limit = self.config.num_request_slots
        if self._host:
            s_lo, s_hi = min_max(slots)
            check_bounds(s_lo, s_hi, 1, limit, f"{op}: request slots")
            n = self.num_tokens.index_select(0, slots)
            lo, hi = min_max(n)
        else:
            n = self.num_tokens.index_select(0, slots.clamp(1, limit))  # clamped: in range
            s_lo, s_hi, lo, hi = torch.stack([*torch.aminmax(slots), *torch.aminmax(n)]).tolist()
            check_bounds(s_lo, s_hi, 1, limit, f"{op}: request slots")
        if lo < 0:
            closed = slots[n < 0]
            raise OwnershipError(f"{op}: request slot {int(closed[0])} is not open")
        if max_tokens is not None and hi > max_tokens:
            raise RequestTooLong(
                f"{op}: a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        self._check_unique(op, slots)
        return n

    def _check_unique(self, op: str, slots: Tensor) -> None:
        if slots.numel() > 1 and not self.scratch.unique(slots):
            raise OwnershipError(f"{op}: a request slot appears twice in one batch")

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
