"""PageAllocator: a free list of units 1..num_pages with one owner per unit. Indices only.

    free[head:]   free units, handed out from the front  owner[u] == 0  <=> u is free
    owner[0]      always 0: unit 0 is the reserved "none" unit, never handed out

NOTE (runs): an allocation takes `free[head:head + n]` in order and a free puts its units back
in front of `head`, in the order given. A fresh allocator so hands out 1, 2, 3, ...; a
request's pages freed together come back as the same ascending run for the next one. PD
transfers merge pages that are consecutive on both sides into one block (one descriptor per
run and layer instead of per page and layer; see docs/pd.md "On a GPU").

NOTE: `alloc` and `free` are all-or-nothing: every check runs before the first write.
Owners are opaque positive ints (a request slot for full pages, a full page for SWA pages).
NOTE: `alloc`, `free` and `check_owned` take any integer dtype (the boundary: their arguments
are converted and checked once); `free_checked` / `check_owned_checked` take int64 vectors on
this device and still check ranges and ownership; `pop`, `claim`, `unclaim` and
`release_claimed` are the unchecked hot paths for callers that already hold valid int64 units.
NOTE (claiming): `claim` subtracts owner + CLAIM_BIAS from each listed unit's owner, so a unit
listed once by its owner reads exactly -CLAIM_BIAS; a unit listed k >= 2 times would need an
owner of sum(owners) + (k - 1) * CLAIM_BIAS >= CLAIM_BIAS to read that, and owners are below
CLAIM_BIAS. One scatter-add and one read check ownership and repeats together; adding the same
values back undoes it exactly. With num_pages < MAX_PAGES no sum overflows int64.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch
from torch import Tensor

from dsv4_worker.mem.args import check_same_shape, int64_vector, resolve_device
from dsv4_worker.mem.errors import IntegrityError, OutOfPages, OwnershipError
from dsv4_worker.mem.usage import PoolUsage

CLAIM_BIAS: Final = 1 << 32  # owners are in 1..CLAIM_BIAS - 1
MAX_PAGES: Final = 1 << 30


class PageAllocator:
    def __init__(self, name: str, num_pages: int, device: torch.device | str = "cpu") -> None:
        if not 0 <= num_pages < MAX_PAGES:
            raise ValueError(f"{name}: num_pages={num_pages} must be in 0..{MAX_PAGES - 1}")
        self.name = name
        self.num_pages = num_pages
        self.device = resolve_device(device)
        # Free units from `_head` on, handed out from the front: 1, 2, 3, ... when fresh.
        self._free = torch.arange(1, num_pages + 1, dtype=torch.int64, device=self.device)
        self._head = 0
        self.owner = torch.zeros(num_pages + 1, dtype=torch.int64, device=self.device)
        self._bias = torch.full((1,), CLAIM_BIAS, dtype=torch.int64, device=self.device)
        self._claimed = torch.neg(self._bias)
        # On the CPU: numpy views of the same memory for `*_host` (never replaced: every write
        # to `owner` and the free list is in place).
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self._host_tags = np.zeros(0, dtype=np.int64)
        if self.device.type == "cpu":
            self._host = (self.owner.numpy(), self._free.numpy())
            self._host_tags = -1 - np.arange(num_pages, dtype=np.int64)  # one per position

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

    def free_units(self) -> Tensor:
        """The free units in the order they will be handed out (a view: valid until the next
        allocation or free)."""
        return self._free[self._head :]

    def alloc(self, owners: Tensor) -> Tensor:
        """One unit per entry of `owners` (in 1..CLAIM_BIAS - 1, unchecked); returns the units,
        same order."""
        owners = int64_vector(owners, f"{self.name}: alloc owners", self.device)
        # clone: later frees overwrite this region of the free list.
        return self.pop(owners).clone()

    def pop(self, owners: Tensor) -> Tensor:
        """`alloc` returning a view of the free list: valid only until the next free (hot paths)."""
        n, head = owners.numel(), self._head
        if n > self.num_pages - head:
            raise OutOfPages(self.name, n, self.num_pages - head)
        pages = self._free[head : head + n]
        self.owner.index_add_(0, pages, owners)  # NOTE: a free unit's owner is 0: adding writes
        self._head = head + n
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
        """Pages in 1..num_pages and owners in 1..CLAIM_BIAS - 1."""
        if pages.numel() == 0:
            return
        if self.device.type == "cpu":  # no sync to share: plain reads
            lo, hi = torch.aminmax(pages)
            owner_lo, owner_hi = torch.aminmax(owners)
            lo_i, hi_i, owner_lo_i, owner_hi_i = int(lo), int(hi), int(owner_lo), int(owner_hi)
        else:
            lo_i, hi_i, owner_lo_i, owner_hi_i = torch.stack(
                [pages.min(), pages.max(), owners.min(), owners.max()]
            ).tolist()
        if lo_i < 1 or hi_i > self.num_pages:
            raise OwnershipError(f"{self.name}: {op} of units outside 1..{self.num_pages}")
        if owner_lo_i < 1 or owner_hi_i >= CLAIM_BIAS:
            raise OwnershipError(f"{self.name}: owners must be in 1..{CLAIM_BIAS - 1}")

    def claim(self, pages: Tensor, owners: Tensor) -> Tensor:
        """First half of a free: raise unless every page is owned by its owner and appears once
        (no double free), then mark the pages claimed (see the NOTE at the top). Returns what
        `unclaim` takes.

        `pages` must be in 1..num_pages and `owners` (one per page, or one for all) in
        1..CLAIM_BIAS - 1 (internal callers guarantee both; `free` checks them). On a raise
        nothing has changed."""
        n = pages.numel()
        if n > self.num_used:
            raise OwnershipError(f"{self.name}: freeing {n} units but only {self.num_used} used")
        biased = owners + CLAIM_BIAS
        if n == 0:
            return biased
        if biased.numel() != n:  # one owner for all: a view, never n additions
            biased = biased.expand(n)
        self.owner.index_add_(0, pages, biased, alpha=-1)
        if not torch.equal(self.owner.index_select(0, pages), self._claimed.expand(n)):
            self.owner.index_add_(0, pages, biased)
            self._raise_not_owned(pages, owners)
        return biased

    def _raise_not_owned(self, pages: Tensor, owners: Tensor) -> None:
        """Why a claim failed (the slow path: nothing has changed)."""
        old = self.owner.index_select(0, pages)
        owners = owners.expand(pages.numel())
        wrong = (old != owners).nonzero()
        if wrong.numel():
            idx = int(wrong[0, 0])
            raise OwnershipError(
                f"{self.name}: unit {int(pages[idx])} is owned by {int(old[idx])}, not by "
                f"{int(owners[idx])} (double free or stale mapping)"
            )
        raise OwnershipError(f"{self.name}: a unit appears twice in one free (double free)")

    def check_owners(self, pages: Tensor, owners: Tensor) -> None:
        """Raise unless every page is owned by its owner; changes nothing. Repeats are not
        detected: for callers whose owners are distinct (an SWA page owned by each of the
        full pages a claim proved distinct cannot appear twice)."""
        if not torch.equal(self.owner.index_select(0, pages), owners):
            self._raise_not_owned(pages, owners)

    def release_owned(self, pages: Tensor) -> None:
        """Second half of a free after `check_owners`: the pages become free, back in front of
        the free list in their order."""
        n = pages.numel()
        if n == 0:
            return
        self.owner.index_fill_(0, pages, 0)
        self._free[self._head - n : self._head] = pages
        self._head -= n

    def unclaim(self, pages: Tensor, claimed: Tensor) -> None:
        """Undo `claim` (another pool of the same free failed its checks); `claimed` is what
        `claim` returned."""
        if pages.numel():
            self.owner.index_add_(0, pages, claimed)

    def release_claimed(self, pages: Tensor) -> None:
        """Second half of a free: the claimed pages become free (owner 0), back in front of the
        free list in their order."""
        n = pages.numel()
        if n == 0:
            return
        self.owner.index_add_(0, pages, self._bias.expand(n))
        self._free[self._head - n : self._head] = pages
        self._head -= n

    # -- the same on the CPU, in numpy (`host_free`: one numpy call costs a fraction of a torch
    # call); only for an allocator on the CPU.

    def claim_host(self, pages: np.ndarray, owner: int) -> None:
        """Raise unless every page of int64 `pages` (in 1..num_pages) is owned by `owner` and
        appears once, then mark them claimed (`release_host` frees them). On a raise nothing
        has changed. Repeats: each position writes its own tag to its page and reads it back;
        a page listed twice keeps one of its tags, so another position reads a wrong one."""
        owners = self._host_views()[0]
        n = len(pages)
        if n > self.num_used:
            raise OwnershipError(f"{self.name}: freeing {n} units but only {self.num_used} used")
        old = owners.take(pages)
        if np.count_nonzero(old != owner):
            self._raise_not_owned(torch.from_numpy(pages), torch.tensor([owner]))
        tags = self._host_tags[:n]
        owners[pages] = tags
        if np.count_nonzero(owners.take(pages) != tags):
            owners[pages] = old
            raise OwnershipError(f"{self.name}: a unit appears twice in one free (double free)")

    def check_owners_host(self, pages: np.ndarray, owners: np.ndarray) -> None:
        """`check_owners` of int64 arrays."""
        if np.count_nonzero(self._host_views()[0].take(pages) != owners):
            self._raise_not_owned(torch.from_numpy(pages), torch.from_numpy(owners))

    def release_host(self, pages: np.ndarray) -> None:
        """`release_claimed` / `release_owned` of int64 pages: free, back in front of the free
        list in their order."""
        owners, free = self._host_views()
        n = len(pages)
        owners[pages] = 0
        free[self._head - n : self._head] = pages
        self._head -= n

    def _host_views(self) -> tuple[np.ndarray, np.ndarray]:
        if self._host is None:
            raise RuntimeError(f"{self.name}: the *_host methods need an allocator on the CPU")
        return self._host

    def check_integrity(self) -> None:
        """free + used == total; the free list is exactly the set of unowned units."""
        n, head = self.num_pages, self._head
        if not 0 <= head <= n:
            raise IntegrityError(f"{self.name}: free list head {head} outside 0..{n}")
        if int(self.owner[0]) != 0:
            raise IntegrityError(f"{self.name}: reserved unit 0 has owner {int(self.owner[0])}")
        free, num_free = self._free[head:], n - head
        if num_free and bool(((free < 1) | (free > n)).any()):
            raise IntegrityError(f"{self.name}: free list holds units outside 1..{n}")
        if int(torch.unique(free).numel()) != num_free:
            raise IntegrityError(f"{self.name}: a unit is on the free list twice")
        if num_free and bool((self.owner[free] != 0).any()):
            raise IntegrityError(f"{self.name}: a unit on the free list has an owner")
        used = int((self.owner[1:] != 0).sum())
        if used + num_free != n:
            raise IntegrityError(f"{self.name}: used {used} + free {num_free} != total {n}")
