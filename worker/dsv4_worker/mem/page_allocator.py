"""PageAllocator: a free list of units 1..num_pages with one owner per unit, kept on the host
(numpy). Indices only; the device never holds this state.

    free[head:]   free units, handed out from the front  owner[u] == 0  <=> u is free
    owner[0]      always 0: unit 0 is the reserved "none" unit, never handed out

NOTE (runs): an allocation takes `free[head:head + n]` in order and a free puts its units back
in front of `head`, in the order given. A fresh allocator so hands out 1, 2, 3, ...; a
request's pages freed together come back as the same ascending run for the next one. PD
transfers merge pages that are consecutive on both sides into one block (one descriptor per
run and layer instead of per page and layer; see docs/pd.md "On a GPU").

NOTE: `alloc` and `free` are all-or-nothing: every check runs before the first write.
Owners are positive ints (a request slot for full pages, a full page for SWA pages).
`alloc`, `free` and `check_owned` are the boundary (any integer array or CPU tensor, checked);
`pop`, `check_free` and `release` are the hot paths of callers that hold valid int64 arrays.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from dsv4_worker.mem.args import check_same_shape, host_ints
from dsv4_worker.mem.errors import IntegrityError, OutOfPages, OwnershipError
from dsv4_worker.mem.usage import PoolUsage

MAX_PAGES: Final = 1 << 30
I64 = np.int64


class PageAllocator:
    def __init__(self, name: str, num_pages: int) -> None:
        if not 0 <= num_pages < MAX_PAGES:
            raise ValueError(f"{name}: num_pages={num_pages} must be in 0..{MAX_PAGES - 1}")
        self.name = name
        self.num_pages = num_pages
        self.owner = np.zeros(num_pages + 1, dtype=I64)
        self._free = np.arange(1, num_pages + 1, dtype=I64)
        self._head = 0
        self._tag = np.zeros(num_pages + 1, dtype=I64)  # scratch: repeat detection
        self._iota = np.arange(num_pages + 1, dtype=I64)

    @property
    def num_free(self) -> int:
        return self.num_pages - self._head

    @property
    def num_used(self) -> int:
        return self._head

    def usage(self) -> PoolUsage:
        return PoolUsage(pool=self.name, used=self.num_used, total=self.num_pages)

    def can_alloc(self, num_pages: int) -> bool:
        return num_pages <= self.num_pages - self._head

    def free_units(self) -> np.ndarray:
        """The free units in the order they will be handed out (a copy)."""
        return self._free[self._head :].copy()

    # -- the boundary ----------------------------------------------------------------------------

    def alloc(self, owners: object) -> np.ndarray:
        """One unit per entry of `owners` (each >= 1); returns the units, same order."""
        owners_h = host_ints(owners, f"{self.name}: alloc owners")
        if owners_h.size and int(owners_h.min()) < 1:
            raise OwnershipError(f"{self.name}: owners must be >= 1")
        return self.pop(owners_h, owners_h.size)

    def free(self, pages: object, owners: object) -> None:
        """Return `pages`, each of which must be owned by the matching entry of `owners`."""
        pages_h, owners_h = self._pair("free", pages, owners)
        self.check_free(pages_h, owners_h)
        self.release(pages_h)

    def check_owned(self, pages: object, owners: object) -> None:
        """Raise unless `free(pages, owners)` would succeed; changes nothing either way."""
        self.check_free(*self._pair("check_owned", pages, owners))

    def _pair(self, op: str, pages: object, owners: object) -> tuple[np.ndarray, np.ndarray]:
        pages_h = host_ints(pages, f"{self.name}: {op} pages")
        owners_h = host_ints(owners, f"{self.name}: {op} owners")
        if pages_h.shape != owners_h.shape:
            check_same_shape(f"{self.name}: {op}", pages_h, owners_h)
        if pages_h.size and (int(pages_h.min()) < 1 or int(pages_h.max()) > self.num_pages):
            raise OwnershipError(f"{self.name}: {op} of units outside 1..{self.num_pages}")
        return pages_h, owners_h

    # -- hot paths -------------------------------------------------------------------------------

    def pop(self, owners: np.ndarray | int, num: int) -> np.ndarray:
        """`num` units owned by `owners` (one per unit, or one for all); a new array."""
        head = self._head
        if num > self.num_pages - head:
            raise OutOfPages(self.name, num, self.num_pages - head)
        pages = self._free[head : head + num].copy()
        self.owner[pages] = owners
        self._head = head + num
        return pages

    def check_free(self, pages: np.ndarray, owners: np.ndarray | int) -> None:
        """Raise OwnershipError unless every page (in 1..num_pages) is owned by its owner and
        listed once (a double free, a stale mapping); changes nothing."""
        n = pages.size
        if n == 0:
            return
        if n > self._head:
            raise OwnershipError(f"{self.name}: freeing {n} units but only {self._head} used")
        held = self.owner[pages]
        if np.count_nonzero(held != owners):
            want = np.broadcast_to(owners, held.shape)
            wrong = int(np.flatnonzero(held != want)[0])
            raise OwnershipError(
                f"{self.name}: unit {int(pages[wrong])} is owned by {int(held[wrong])}, not by "
                f"{int(want[wrong])} (double free or stale mapping)"
            )
        if n > 1:
            if n > self.num_pages:
                raise OwnershipError(f"{self.name}: a unit appears twice in one free (double free)")
            iota = self._iota[:n]
            self._tag[pages] = iota  # a repeated page keeps one of its positions
            if np.count_nonzero(self._tag[pages] != iota):
                raise OwnershipError(f"{self.name}: a unit appears twice in one free (double free)")

    def release(self, pages: np.ndarray) -> None:
        """Free checked `pages`: back in front of the free list, in their order."""
        n = pages.size
        if n == 0:
            return
        self.owner[pages] = 0
        self._free[self._head - n : self._head] = pages
        self._head -= n

    def check_integrity(self) -> None:
        """free + used == total; the free list is exactly the set of unowned units."""
        n, head = self.num_pages, self._head
        if not 0 <= head <= n:
            raise IntegrityError(f"{self.name}: free list head {head} outside 0..{n}")
        if int(self.owner[0]) != 0:
            raise IntegrityError(f"{self.name}: reserved unit 0 has owner {int(self.owner[0])}")
        free = self._free[head:]
        if free.size and (int(free.min()) < 1 or int(free.max()) > n):
            raise IntegrityError(f"{self.name}: free list holds units outside 1..{n}")
        if np.unique(free).size != free.size:
            raise IntegrityError(f"{self.name}: a unit is on the free list twice")
        if np.count_nonzero(self.owner[free]):
            raise IntegrityError(f"{self.name}: a unit on the free list has an owner")
        if int(self.owner[1:].min(initial=0)) < 0:
            raise IntegrityError(f"{self.name}: a unit has a negative owner")
        used = int(np.count_nonzero(self.owner[1:]))
        if used + free.size != n:
            raise IntegrityError(f"{self.name}: used {used} + free {free.size} != total {n}")
