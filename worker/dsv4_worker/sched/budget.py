"""Resource arithmetic of the scheduler, pure (no tensors): what an extend, a decode step or a
resume needs from each pool, and the one multi-resource admission function every caller uses
(prefill admission now; PD decode preallocation and retraction resume reuse it).

The needs mirror the allocator exactly (`KVAllocator._plan_extend` / `_plan_decode`): an extend
of k tokens after n0 takes pages_for(n0 + k) - pages_for(n0) full pages and as many SWA pages
(a chunk is written in full); a decode step takes one of each when n0 % P == 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from dsv4_common.core.index_space import pages_for_tokens


@dataclass(frozen=True, slots=True)
class Need:
    full_pages: int = 0
    swa_pages: int = 0
    request_slots: int = 0

    def __add__(self, other: Need) -> Need:
        return Need(
            self.full_pages + other.full_pages,
            self.swa_pages + other.swa_pages,
            self.request_slots + other.request_slots,
        )


NOTHING: Final = Need()


@dataclass(frozen=True, slots=True)
class PoolRoom:
    """Room in each pool, in its own units (pages, slots): the free units at one step, or
    the pools' totals (what `admit` compares a `Need` with)."""

    full_pages: int
    swa_pages: int
    request_slots: int

    def covers(self, need: Need) -> bool:
        return (
            need.full_pages <= self.full_pages
            and need.swa_pages <= self.swa_pages
            and need.request_slots <= self.request_slots
        )

    def minus(self, need: Need) -> PoolRoom:
        return PoolRoom(
            self.full_pages - need.full_pages,
            self.swa_pages - need.swa_pages,
            self.request_slots - need.request_slots,
        )

    def short_of(self, need: Need) -> str:
        """The pools `need` does not fit, for messages."""
        out = []
        if need.full_pages > self.full_pages:
            out.append(f"{need.full_pages} full pages (have {self.full_pages})")
        if need.swa_pages > self.swa_pages:
            out.append(f"{need.swa_pages} SWA pages (have {self.swa_pages})")
        if need.request_slots > self.request_slots:
            out.append(f"{need.request_slots} request slots (have {self.request_slots})")
        return ", ".join(out)


def extend_need(num_tokens: int, num_new: int, page_size: int) -> Need:
    pages = pages_for_tokens(num_tokens + num_new, page_size) - pages_for_tokens(
        num_tokens, page_size
    )
    return Need(pages, pages)


def decode_need(num_tokens: int, page_size: int) -> Need:
    page = 1 if num_tokens % page_size == 0 else 0
    return Need(page, page)


class Fit(StrEnum):
    NOW = "now"  # every pool has room: act
    LATER = "later"  # a pool is short now; running requests will release it
    NEVER = "never"  # larger than the pools themselves: reject or shrink


@dataclass(frozen=True, slots=True)
class Admission:
    fit: Fit
    reason: str = ""


def admit(need: Need, free: PoolRoom, total: PoolRoom, reserved: Need = NOTHING) -> Admission:
    """The one admission function: does `need` fit now, later, or never, given the free units,
    the pools' totals and units `reserved` for running requests (decode headroom)?"""
    if not total.covers(need):
        return Admission(Fit.NEVER, f"needs {total.short_of(need)} in total")
    available = free.minus(reserved)
    if available.covers(need):
        return Admission(Fit.NOW)
    return Admission(Fit.LATER, f"waits for {available.short_of(need)}")
