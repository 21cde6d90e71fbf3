"""KVAllocator: full (virtual) pages, physical SWA pages and the full->SWA page mapping.

Indices only (bytes live in `KVPool`). Per request slot r, P = page_size:

    num_tokens[r]          tokens holding a full slot; -1 = slot closed
    page_table[r, c]       full page of positions [c*P, (c+1)*P); 0 = none
    swa_start_tokens[r]    page-aligned; page columns c < swa_start/P have no SWA page
    full_to_swa[f]         SWA page of full page f; 0 = none (compressed pools use f itself)

NOTE (host state): all of it, and both pools' free lists and owners, live on the host (numpy;
`tables.py`); the device holds copies of the two tables the forward reads. Every size, check
and decision reads host data, so no operation makes a device sync (SGLang sizes its batches
from `seq_lens_cpu` the same way); the device copies are written from the host's changes by
one upload per operation.

NOTE (window invariant, checked by `check_integrity`): for an open request, a column
c < ceil(n/P) has an SWA page iff c >= swa_start/P, and swa_start <= window_floor(n), where
window_floor(n) = floor_to_page(max(0, n - window - draft)). Tokens in [n - window - draft, n)
therefore always keep SWA rows; eviction raises swa_start to window_floor(n).
NOTE: every operation validates before its first write (all-or-nothing): arguments first
(`args.py`: host arrays or tensors of any integer dtype, 1-D, slots in 1..num_request_slots,
counts bounded before any int64 arithmetic), then ownership, length and free pages. Every free
checks ownership on both pools (a double free or a stale mapping raises OwnershipError).
NOTE: `can_extend` / `can_decode` run the same checks as `extend` / `decode` (the `_plan_*`
methods) and return the error as a `Verdict` instead of raising it, so they agree exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dsv4_worker.mem.alloc_config import CLOSED, AllocatorConfig
from dsv4_worker.mem.args import check_bounds, check_same_shape, host_ints, int_arg, resolve_device
from dsv4_worker.mem.device import host_shortcuts
from dsv4_worker.mem.errors import (
    InvalidArgument,
    KVMemoryError,
    OutOfPages,
    OwnershipError,
    RequestTooLong,
    Verdict,
)
from dsv4_worker.mem.held import held_by_batch
from dsv4_worker.mem.integrity import check_kv_allocator
from dsv4_worker.mem.page_allocator import PageAllocator
from dsv4_worker.mem.runs import pages_for, per_item, runs
from dsv4_worker.mem.tables import Change, DeviceTables, HostTables
from dsv4_worker.mem.usage import PoolUsage

I64 = np.int64
_YES = Verdict()
_NONE = np.zeros(0, dtype=I64)
_SMALL = 8  # batches up to this size are checked with Python ints


class _ExtendPlan(NamedTuple):
    """A checked `extend`: applying it cannot fail."""

    slots: np.ndarray
    num_new: np.ndarray
    n0: np.ndarray  # tokens before
    first_cols: np.ndarray  # first new page column of each request
    counts: np.ndarray  # new pages of each request
    total_pages: int


class _DecodePlan(NamedTuple):
    """A checked `decode`: applying it cannot fail."""

    slots: np.ndarray
    n0: np.ndarray  # tokens before
    cols: np.ndarray  # page column of each next token
    offsets: np.ndarray  # its offset in that page
    rollover: np.ndarray  # positions in `slots` whose token starts a page


class _Columns(NamedTuple):
    """New pages written to the host tables: the changes for the device copies."""

    table: Change
    full_to_swa: Change


class KVAllocator:
    def __init__(self, config: AllocatorConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = resolve_device(device)
        slots, cols = config.num_request_slots + 1, config.max_pages_per_request
        self.full = PageAllocator("full", config.num_full_pages)
        self.swa = PageAllocator("swa", config.num_swa_pages)
        self.host = HostTables(
            page_table=np.zeros((slots, cols), dtype=I64),
            full_to_swa=np.zeros(config.num_full_pages + 1, dtype=I64),
            num_tokens=np.full(slots, CLOSED, dtype=I64),
            swa_start_tokens=np.zeros(slots, dtype=I64),
        )
        self._table_flat = self.host.page_table.reshape(-1)  # a view: index = slot * cols + c
        self.tables = DeviceTables(self.host, self.device, shared=host_shortcuts(self.device))
        self.page_table = self.tables.page_table  # the device's copies (the forward reads them)
        self.full_to_swa = self.tables.full_to_swa
        self._tag = np.zeros(slots, dtype=I64)  # scratch: repeat detection
        self._iota = np.arange(slots, dtype=I64)

    @property
    def num_tokens(self) -> Tensor:
        """The host's `num_tokens` as a CPU tensor (a view: reading it costs no device sync)."""
        return torch.from_numpy(self.host.num_tokens)

    @property
    def swa_start_tokens(self) -> Tensor:
        """The host's `swa_start_tokens` as a CPU tensor (a view)."""
        return torch.from_numpy(self.host.swa_start_tokens)

    # -- queries ---------------------------------------------------------------------------------

    def window_floor(self, num_tokens: np.ndarray) -> np.ndarray:
        """Page-aligned token count below which no SWA row is needed any more."""
        keep, page = self.config.retained_tokens, self.config.page_size
        floor: np.ndarray = (np.maximum(num_tokens, keep) - keep) // page * page  # no overflow
        return floor

    def open_slots(self) -> np.ndarray:
        return np.flatnonzero(self.host.num_tokens >= 0)

    def request_pages(self, slot: int) -> tuple[Tensor, Tensor]:
        """(full page per column, its SWA page or 0) of one open request, as CPU tensors (host
        copies: reading them costs no device sync)."""
        slot = int_arg(slot, "request_pages: slot", 1, self.config.num_request_slots)
        n = int(self.host.num_tokens[slot])
        if n < 0:
            raise OwnershipError(f"request slot {slot} is not open")
        full = self.host.page_table[slot, : -(-n // self.config.page_size)].copy()
        return torch.from_numpy(full), torch.from_numpy(self.host.full_to_swa[full])

    def can_extend(self, slots: object, num_new_tokens: object) -> Verdict:
        """Whether `extend(slots, num_new_tokens)` would succeed; else the error it would raise."""
        return _verdict(lambda: self._plan_extend(slots, num_new_tokens))

    def can_decode(self, slots: object) -> Verdict:
        """Whether `decode(slots)` would succeed; else the error it would raise."""
        return _verdict(lambda: self._plan_decode(slots))

    def usage(self) -> tuple[PoolUsage, PoolUsage]:
        return self.full.usage(), self.swa.usage()

    def check_integrity(self) -> None:
        check_kv_allocator(self)

    # -- request lifecycle -----------------------------------------------------------------------

    def open(self, slots: object) -> None:
        """Start tracking fresh request slots (0 tokens)."""
        s = self._slots("open", slots)
        if s.size == 0:
            return
        check_bounds(int(s.min()), int(s.max()), 1, self.config.num_request_slots, "open: slots")
        host = self.host
        if not self._unique(s) or int(host.num_tokens[s].max()) != CLOSED:
            raise OwnershipError("open: a request slot is already open or repeated in the batch")
        host.num_tokens[s] = 0
        host.swa_start_tokens[s] = 0

    def free(self, slots: object) -> None:
        """Free every full and SWA page of the requests and close their slots."""
        s = self._slots("free", slots)
        if s.size:
            self.free_checked(s)

    def free_checked(self, slots: np.ndarray) -> None:
        """`free` of a non-empty int64 host array (the boundary converted it); ranges,
        ownership and repeats are still checked here."""
        host = self.host
        held = held_by_batch(self, slots, self._checked_num_tokens("free", slots))
        # NOTE: the SWA pool's check comes first: it writes nothing, and a full page's check
        # proves the full pages distinct only after.
        self.swa.check_free(held.swa_pages, held.swa_owners)
        self.full.check_free(held.pages, held.owners)
        # All checks passed: mutate. Evicted columns' mappings read 0 already (checked).
        self.swa.release(held.swa_pages)
        host.full_to_swa[held.swa_owners] = 0
        self.full.release(held.pages)
        self._table_flat[held.table_index] = 0
        host.num_tokens[slots] = CLOSED
        host.swa_start_tokens[slots] = 0
        self.tables.apply(table=(held.table_index, None), full_to_swa=(held.swa_owners, None))

    # -- allocation ------------------------------------------------------------------------------

    def extend(self, slots: object, num_new_tokens: object) -> Tensor:
        """Grow each request by `num_new_tokens[i]` (prefill chunk); returns the new tokens' full
        slots, request-major, on the device. Every new page gets an SWA page (the chunk is
        written in full)."""
        plan = self._plan_extend(slots, num_new_tokens)
        s = plan.slots
        if s.size == 0:
            return self.tables.apply()
        new = None
        if plan.total_pages:
            new = self._alloc_columns(s, plan.first_cols, plan.counts, plan.total_pages, None)
        self.host.num_tokens[s] = plan.n0 + plan.num_new
        out = self._token_slots(s, plan.n0, plan.num_new)
        if new is None:
            return self.tables.apply(out=out)
        return self.tables.apply(new.table, new.full_to_swa, out)

    def _plan_extend(self, slots: object, num_new_tokens: object) -> _ExtendPlan:
        s = self._slots("extend", slots)
        num_new = self._ints(num_new_tokens, "extend: num_new_tokens")
        if num_new.shape != s.shape:
            check_same_shape("extend", s, num_new)
        if s.size == 0:
            return _ExtendPlan(s, num_new, s, s, s, 0)
        n0 = self._checked_num_tokens("extend", s)
        lowest = int(num_new.min())
        if lowest < 0:
            raise InvalidArgument(f"extend: num_new_tokens must be >= 0, got {lowest}")
        # NOTE: bounded against the room left (never n0 + k, which can overflow int64).
        if np.count_nonzero(num_new > self.config.max_tokens_per_request - n0):
            raise RequestTooLong(
                f"extend: a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        page = self.config.page_size
        first_cols = pages_for(n0, page)
        counts = pages_for(n0 + num_new, page) - first_cols
        total_pages = int(counts.sum())
        self._check_free(total_pages, total_pages)
        return _ExtendPlan(s, num_new, n0, first_cols, counts, total_pages)

    def decode(self, slots: object) -> Tensor:
        """One more token per request; a page (and its SWA page) only at a page boundary.
        Returns each request's new full slot, on the device."""
        s, n0, cols, offsets, roll = self._plan_decode(slots)
        if s.size == 0:
            return self.tables.apply()
        flat = s * self.config.max_pages_per_request
        flat += cols  # the page-table entry of each next token
        table: Change | None = None
        to_swa: Change | None = None
        if roll.size:  # the requests at a page boundary get a page and its SWA page
            new_flat = flat[roll]
            pages = self.full.pop(s[roll], roll.size)
            swa = self.swa.pop(pages, roll.size)
            self._table_flat[new_flat] = pages
            self.host.full_to_swa[pages] = swa
            table, to_swa = (new_flat, pages), (pages, swa)
        out = self._table_flat[flat]
        out *= self.config.page_size
        out += offsets
        self.host.num_tokens[s] = n0 + 1
        return self.tables.apply(table, to_swa, out)

    def _plan_decode(self, slots: object) -> _DecodePlan:
        s = self._slots("decode", slots)
        if s.size == 0:
            return _DecodePlan(s, s, s, s, s)
        max_tokens = self.config.max_tokens_per_request - 1
        n0 = self._checked_num_tokens("decode", s, max_tokens=max_tokens)
        cols, offsets = np.divmod(n0, self.config.page_size)
        at_boundary = offsets == 0
        if not np.count_nonzero(at_boundary):  # the steady step
            return _DecodePlan(s, n0, cols, offsets, _NONE)
        rollover = np.flatnonzero(at_boundary)
        self._check_free(rollover.size, rollover.size)
        return _DecodePlan(s, n0, cols, offsets, rollover)

    def alloc_tail(self, slots: object, num_tokens: object) -> None:
        """PD decode preallocation for fresh requests: full pages for all `num_tokens`, SWA pages
        only for the page-floored window tail [window_floor(n), n)."""
        s = self._slots("alloc_tail", slots)
        n = self._ints(num_tokens, "alloc_tail: num_tokens")
        self._alloc_sparse("alloc_tail", s, n, None)

    def alloc_sparse(self, slots: object, num_tokens: object, swa_start_tokens: object) -> None:
        """Allocate fresh requests (0 tokens) to `num_tokens`, with SWA pages only for columns
        >= swa_start/P (page-aligned, <= window_floor(n)). Used by PD preallocation and reload.

        NOTE (#25805): every mapping entry of the new full pages is written, the non-tail ones
        with 0, so a recycled page can never carry a previous owner's SWA page."""
        op = "alloc_sparse"
        s = self._slots(op, slots)
        n = self._ints(num_tokens, f"{op}: num_tokens")
        start = self._ints(swa_start_tokens, f"{op}: swa_start_tokens")
        self._alloc_sparse(op, s, n, start)

    def _alloc_sparse(
        self, op: str, slots: np.ndarray, num_tokens: np.ndarray, swa_start: np.ndarray | None
    ) -> None:
        """Checked arguments in; `swa_start` None: the window tail (`window_floor`)."""
        if swa_start is None:
            check_same_shape(op, slots, num_tokens)
        else:
            check_same_shape(op, slots, num_tokens, swa_start)
        if slots.size == 0:
            return
        n0 = self._checked_num_tokens(op, slots)
        if np.count_nonzero(n0):
            raise OwnershipError(f"{op}: every request must be open and still empty")
        if int(num_tokens.max()) > self.config.max_tokens_per_request:
            raise RequestTooLong(
                f"{op}: a request exceeds {self.config.max_tokens_per_request} tokens"
            )
        page = self.config.page_size
        floor = self.window_floor(num_tokens)
        if swa_start is None:
            if int(num_tokens.min()) < 0:
                raise InvalidArgument(f"{op}: num_tokens must be >= 0")
            swa_start = floor
        elif np.count_nonzero(
            (num_tokens < 0) | (swa_start % page != 0) | (swa_start < 0) | (swa_start > floor)
        ):
            raise InvalidArgument(
                f"{op}: num_tokens must be >= 0 and swa_start_tokens page-aligned, "
                ">= 0 and <= window_floor(num_tokens)"
            )
        p1 = pages_for(num_tokens, page)
        start_cols = swa_start // page
        total_full = int(p1.sum())
        total_swa = total_full - int(np.minimum(start_cols, p1).sum())
        self._check_free(total_full, total_swa)
        new = None
        if total_full:
            new = self._alloc_columns(slots, None, p1, total_full, start_cols)
        self.host.num_tokens[slots] = num_tokens
        self.host.swa_start_tokens[slots] = swa_start
        if new is not None:
            self.tables.apply(new.table, new.full_to_swa)

    def evict_window(self, slots: object = None) -> int:
        """Free the SWA pages that slid out of the window (all open requests by default).
        Returns the number of SWA pages freed; never frees a page holding an in-window token."""
        host, page = self.host, self.config.page_size
        if slots is None:
            s = self.open_slots()
            if s.size == 0:
                return 0
            n = host.num_tokens[s]
        else:
            s = self._slots("evict_window", slots)
            if s.size == 0:
                return 0
            n = self._checked_num_tokens("evict_window", s)
        start = host.swa_start_tokens[s]
        target = np.maximum(self.window_floor(n), start)
        counts = (target - start) // page
        total = int(counts.sum())
        if total == 0:
            return 0
        batch, within = runs(counts, total)
        rows = per_item(s, batch)
        cols = per_item(start // page, batch) + within
        pages = self._table_flat[cols + rows * self.config.max_pages_per_request]
        swa_pages = host.full_to_swa[pages]
        if int(swa_pages.min()) < 1 or np.count_nonzero(self.full.owner[pages] != rows):
            raise OwnershipError("evict_window: an in-window column has no SWA page or owner")
        self.swa.check_free(swa_pages, pages)
        self.swa.release(swa_pages)
        host.full_to_swa[pages] = 0
        host.swa_start_tokens[s] = target
        self.tables.apply(full_to_swa=(pages, None))
        return total

    # -- internals -------------------------------------------------------------------------------

    def _alloc_columns(
        self,
        slots: np.ndarray,
        first_cols: np.ndarray | None,
        counts: np.ndarray,
        total: int,
        swa_from: np.ndarray | None,
    ) -> _Columns:
        """Fill columns [first_cols[i], first_cols[i] + counts[i]) of each request with new full
        pages (None: from column 0); map an SWA page to every new page (or to those at columns
        >= swa_from[i], the others to 0)."""
        batch, within = runs(counts, total)
        rows = per_item(slots, batch)
        cols = within if first_cols is None else per_item(first_cols, batch) + within
        pages = self.full.pop(rows if batch is not None else int(slots[0]), total)
        flat = cols + rows * self.config.max_pages_per_request
        self._table_flat[flat] = pages
        if swa_from is None:
            swa = self.swa.pop(pages, total)
        else:
            tail = cols >= per_item(swa_from, batch)
            tail_pages = pages[tail]
            swa = np.zeros(total, dtype=I64)
            swa[tail] = self.swa.pop(tail_pages, tail_pages.size)
        self.host.full_to_swa[pages] = swa
        return _Columns((flat, pages), (pages, swa))

    def _token_slots(self, slots: np.ndarray, n0: np.ndarray, num_new: np.ndarray) -> np.ndarray:
        page = self.config.page_size
        batch, within = runs(num_new, int(num_new.sum()))
        positions = per_item(n0, batch) + within
        flat = positions // page + per_item(slots, batch) * self.config.max_pages_per_request
        out: np.ndarray = self._table_flat[flat] * page + positions % page
        return out

    def _slots(self, op: str, slots: object) -> np.ndarray:
        """`slots` as a 1-D int64 host array (ranges are checked where they are used)."""
        return self._ints(slots, f"{op}: slots")

    def _ints(self, value: object, what: str) -> np.ndarray:
        return host_ints(value, what, self.device, shared=self.tables.shared)

    def _checked_num_tokens(
        self, op: str, slots: np.ndarray, max_tokens: int | None = None
    ) -> np.ndarray:
        """num_tokens of a non-empty batch; raises on a slot outside 1..num_request_slots (0 is
        reserved), a closed or repeated slot, or one holding more than `max_tokens` (no
        writes)."""
        limit = self.config.num_request_slots
        bound = self.config.max_tokens_per_request if max_tokens is None else max_tokens
        if slots.size <= _SMALL:  # Python's min and max cost less than numpy's here
            values = slots.tolist()
            check_bounds(min(values), max(values), 1, limit, f"{op}: slots")
            n: np.ndarray = self.host.num_tokens[slots]
            counts = n.tolist()
            bad = min(counts) < 0 or max(counts) > bound
        else:
            # NOTE: one max each, as unsigned: a value below the range wraps past its top.
            if int((slots - 1).view(np.uint64).max()) >= limit:
                check_bounds(int(slots.min()), int(slots.max()), 1, limit, f"{op}: slots")
            n = self.host.num_tokens[slots]
            bad = int(n.view(np.uint64).max()) > bound  # a closed slot's -1 reads 2**64 - 1
        if bad:
            if int(n.min()) < 0:
                closed = int(slots[np.flatnonzero(n < 0)[0]])
                raise OwnershipError(f"{op}: request slot {closed} is not open")
            raise RequestTooLong(
                f"{op}: a request would exceed {self.config.max_tokens_per_request} tokens"
            )
        if not self._unique(slots):
            raise OwnershipError(f"{op}: a request slot appears twice in one batch")
        return n

    def _unique(self, slots: np.ndarray) -> bool:
        """No slot repeats; `slots` must lie in 0..num_request_slots."""
        n = slots.size
        if n < 2:
            return True
        if n > self._iota.size:
            return False  # more entries than slots: some slot repeats
        iota = self._iota[:n]
        self._tag[slots] = iota  # a repeated slot keeps one of its positions
        return not np.count_nonzero(self._tag[slots] != iota)

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
