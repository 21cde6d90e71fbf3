"""Typed index spaces and the only conversions between them. Pure Python, scalar form.

    space        | unit                         | 0 means
    -------------|------------------------------|---------------------------
    FullSlot     | one token in the virtual full space (page p holds slots [p*P, (p+1)*P)) | none
    FullPage     | P full slots; also addresses c_r pages and indexer pages (page identity) | none
    SwaSlot      | one row of the physical SWA KV pool                                     | none
    SwaPage      | P SWA slots; owns one compressor ring per page-state component           | none
    ReqSlot      | one request's request-scoped state (HCA rings)                          | none

NOTE: page identity holds because `page_size % ratio == 0` for every compression ratio:
the compressed row of full slot t is t // r, and (t // r) // (P // r) == t // P.
The vectorized (torch) forms of these live in `dsv4_worker.mem` and must agree with these.
"""

from __future__ import annotations

from typing import NewType

FullSlot = NewType("FullSlot", int)
FullPage = NewType("FullPage", int)
SwaSlot = NewType("SwaSlot", int)
SwaPage = NewType("SwaPage", int)
ReqSlot = NewType("ReqSlot", int)

NONE = 0  # slot / page 0 is reserved as "none" in every space


def full_page_of(slot: FullSlot, page_size: int) -> FullPage:
    return FullPage(slot // page_size)


def full_slot_at(page: FullPage, offset: int, page_size: int) -> FullSlot:
    assert 0 <= offset < page_size, f"offset {offset} outside a page of {page_size}"
    return FullSlot(page * page_size + offset)


def swa_page_of(slot: SwaSlot, page_size: int) -> SwaPage:
    return SwaPage(slot // page_size)


def swa_slot_at(page: SwaPage, offset: int, page_size: int) -> SwaSlot:
    assert 0 <= offset < page_size, f"offset {offset} outside a page of {page_size}"
    return SwaSlot(page * page_size + offset)


def compressed_row_of(slot: FullSlot, ratio: int) -> int:
    """Row of the ratio-r compressed pool that token `slot` completes (valid at block ends)."""
    return slot // ratio


def completes_block(slot: FullSlot, ratio: int) -> bool:
    """True when `slot` is the last token of a ratio-r block, i.e. a compressed row is due."""
    return (slot + 1) % ratio == 0


def compressed_page_of(row: int, ratio: int, page_size: int) -> FullPage:
    """Page identity: the compressed page number equals the full page number."""
    return FullPage(row // (page_size // ratio))


def page_state_row(slot: SwaSlot, page_size: int, ring_rows: int) -> int:
    """Ring row of a per-SWA-page compressor state for the token at SWA slot `slot`."""
    return swa_page_of(slot, page_size) * ring_rows + slot % ring_rows


def request_state_row(req: ReqSlot, position: int, ring_rows: int) -> int:
    """Ring row of a request-scoped compressor state for sequence position `position`."""
    return req * ring_rows + position % ring_rows


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def floor_to_page(num_tokens: int, page_size: int) -> int:
    return num_tokens // page_size * page_size


def window_floor(num_tokens: int, page_size: int, retained_tokens: int) -> int:
    """Page-aligned token count below which a request needs no SWA row any more (scalar form
    of `KVAllocator.window_floor`): tokens in [n - retained, n) keep their SWA rows."""
    return floor_to_page(max(0, num_tokens - retained_tokens), page_size)


def tail_pages(num_tokens: int, page_size: int, retained_tokens: int) -> int:
    """SWA pages of the page-floored window tail [window_floor(n), n): what PD decode
    preallocates for a prompt of n tokens (never the whole prompt)."""
    start = window_floor(num_tokens, page_size, retained_tokens) // page_size
    return pages_for_tokens(num_tokens, page_size) - start
