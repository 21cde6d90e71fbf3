"""PageAllocator: a free stack of units 1..num_pages with one owner per unit. Indices only.

    stack[0:top]  free units (popped from the top)      owner[u] == 0  <=> u is free
    owner[0]      always 0: unit 0 is the reserved "none" unit, never handed out

NOTE: `alloc` and `free` are all-or-nothing: every check runs before the first write.
Owners are opaque positive ints (a request slot for full pages, a full page for SWA pages).
NOTE: `alloc`, `free` and `check_owned` take any integer dtype (the boundary: their arguments
are converted and checked once); `free_checked` / `check_owned_checked` take int64 vectors on
this device and still check ranges and ownership; `pop`, `claim`, `unclaim` and
`release_claimed` are the unchecked hot paths for callers that already hold valid int64 units.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4_worker.mem.args import check_same_shape, int64_vector, resolve_device
from dsv4_worker.mem.errors import IntegrityError, OutOfPages, OwnershipError
from dsv4_worker.mem.usage import PoolUsage


class PageAllocator:
    def __init__(self, name: str, num_pages: int, device: torch.device | str = "cpu") -> None:
        if num_pages < 0:
            raise ValueError(f"{name}: num_pages={num_pages} must be >= 0")
        self.name = name
        self.num_pages = num_pages
        self.device = resolve_device(device)
        # Free units, popped from the end: a fresh allocator hands out low numbers first.
        self._stack = torch.arange(num_pages, 0, -1, dtype=torch.int64, device=self.device)
        self._top = num_pages
        self.owner = torch.zeros(num_pages + 1, dtype=torch.int64, device=self.device)
        self._neg_tags = -1 - torch.arange(num_pages + 1, dtype=torch.int64, device=self.device)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    def usage(self) -> PoolUsage:
        return PoolUsage(pool=self.name, used=self.num_used, total=self.num_pages)

    def can_alloc(self, num_pages: int) -> bool:
        return num_pages <= self._top

    def alloc(self, owners: Tensor) -> Tensor:
        """One unit per entry of `owners` (all > 0, unchecked); returns the units, same order."""
        owners = int64_vector(owners, f"{self.name}: alloc owners", self.device)
        # clone: later frees overwrite this region of the stack.
        return self.pop(owners).clone()

    def pop(self, owners: Tensor) -> Tensor:
        """`alloc` returning a view of the stack: valid only until the next free (hot paths)."""
        n = owners.numel()
        if n > self._top:
            raise OutOfPages(self.name, n, self._top)
        pages = self._stack[self._top - n : self._top]
        self.owner.index_add_(0, pages, owners)  # NOTE: a free unit's owner is 0: adding writes
        self._top -= n
        return pages

    def free(self, pages: Tensor, owners: Tensor) -> None:
        """Return `pages`, each of which must be owned by the matching entry of `owners`."""
        self.free_checked(*self._vectors("free", pages, owners))

    def free_checked(self, pages: Tensor, owners: Tensor) -> None:
        """`free` of int64 vectors of one shape on this device."""
        self._check_ranges("free", pages, owners)
        self.claim(pages, owners)
        self.release_claimed(pages)

    def check_owned(self, pages: Tensor, owners: Tensor) -> None:
        """Raise unless `free(pages, owners)` would succeed; changes nothing either way."""
        self.check_owned_checked(*self._vectors("check_owned", pages, owners))

    def check_owned_checked(self, pages: Tensor, owners: Tensor) -> None:
        """`check_owned` of int64 vectors of one shape on this device."""
        self._check_ranges("check_owned", pages, owners)
        self.unclaim(pages, self.claim(pages, owners))

    def _vectors(self, op: str, pages: Tensor, owners: Tensor) -> tuple[Tensor, Tensor]:
        """(pages, owners) as int64 vectors of one shape (the boundary's conversion)."""
        pages = int64_vector(pages, f"{self.name}: {op} pages", self.device)
        owners = int64_vector(owners, f"{self.name}: {op} owners", self.device)
        check_same_shape(f"{self.name}: {op}", pages, owners)
        return pages, owners

    def _check_ranges(self, op: str, pages: Tensor, owners: Tensor) -> None:
        """Pages in 1..num_pages and owners >= 1."""
        if pages.numel() == 0:
            return
        if self.device.type == "cpu":  # no sync to share: plain reads
            lo, hi = torch.aminmax(pages)
            lo_i, hi_i, owner_lo = int(lo), int(hi), int(owners.min())
        else:
            lo_i, hi_i, owner_lo = torch.stack([pages.min(), pages.max(), owners.min()]).tolist()
        if lo_i < 1 or hi_i > self.num_pages:
            raise OwnershipError(f"{self.name}: {op} of units outside 1..{self.num_pages}")
        if owner_lo < 1:
            raise OwnershipError(f"{self.name}: owners must be >= 1")

    def claim(self, pages: Tensor, owners: Tensor) -> Tensor:
        """First half of a free: raise unless every page is owned by its owner and appears once
        (no double free), then mark the pages claimed. Returns the owners for `unclaim`.

        `pages` must be in 1..num_pages and `owners` >= 1 (internal callers guarantee both;
        `free` checks them). On a raise nothing has changed."""
        n = pages.numel()
        if n > self.num_used:
            raise OwnershipError(f"{self.name}: freeing {n} units but only {self.num_used} used")
        old = self.owner.index_select(0, pages)
        if n == 0:
            return old
        if not torch.equal(old, owners):
            idx = int((old != owners).nonzero()[0, 0])
            raise OwnershipError(
                f"{self.name}: unit {int(pages[idx])} is owned by {int(old[idx])}, not by "
                f"{int(owners[idx])} (double free or stale mapping)"
            )
        # Claim each page with a unique negative tag; a page repeated in the batch keeps one tag.
        tag = self._neg_tags[:n]
        self.owner.index_copy_(0, pages, tag)
        if not torch.equal(self.owner.index_select(0, pages), tag):
            self.owner.index_copy_(0, pages, old)
            raise OwnershipError(f"{self.name}: a unit appears twice in one free (double free)")
        return old

    def unclaim(self, pages: Tensor, owners: Tensor) -> None:
        """Undo `claim` (another pool of the same free failed its checks)."""
        if pages.numel():
            self.owner.index_copy_(0, pages, owners)

    def release_claimed(self, pages: Tensor) -> None:
        """Second half of a free: push claimed pages back onto the free stack."""
        n = pages.numel()
        if n == 0:
            return
        self.owner.index_fill_(0, pages, 0)
        self._stack[self._top : self._top + n] = pages
        self._top += n

    def check_integrity(self) -> None:
        """free + used == total; the free stack is exactly the set of unowned units."""
        n, top = self.num_pages, self._top
        if not 0 <= top <= n:
            raise IntegrityError(f"{self.name}: stack top {top} outside 0..{n}")
        if int(self.owner[0]) != 0:
            raise IntegrityError(f"{self.name}: reserved unit 0 has owner {int(self.owner[0])}")
        free = self._stack[:top]
        if top and bool(((free < 1) | (free > n)).any()):
            raise IntegrityError(f"{self.name}: free stack holds units outside 1..{n}")
        if int(torch.unique(free).numel()) != top:
            raise IntegrityError(f"{self.name}: a unit is on the free stack twice")
        if top and bool((self.owner[free] != 0).any()):
            raise IntegrityError(f"{self.name}: a unit on the free stack has an owner")
        used = int((self.owner[1:] != 0).sum())
        if used + top != n:
            raise IntegrityError(f"{self.name}: used {used} + free {top} != total {n}")
