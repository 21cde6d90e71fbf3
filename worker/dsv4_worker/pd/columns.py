"""What one transfer step of a PD request moves, as page columns: the one pure function both
sides use (prefill maps the columns to its source units, decode to its destination units).

For a request of n prompt tokens, P tokens per page, window + draft = W retained tokens:

    chunk k (not last) : FULL_PAGE units of columns [sent, floor(n_k / P))   (whole pages only)
    last               : FULL_PAGE units of columns [sent, ceil(n / P)),
                         SWA_PAGE units of columns [window_floor(n) / P, ceil(n / P)),
                         the request slot's REQ_SLOT units (compressor state)

`window_floor(n) = floor_to_page(max(0, n - W))` is also where `KVAllocator.alloc_tail` starts
decode's SWA pages, so the SWA columns sent are exactly the ones decode preallocated. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_common.core.index_space import pages_for_tokens, window_floor


@dataclass(frozen=True, slots=True)
class SendStep:
    full_cols: range  # page columns whose FULL_PAGE units travel
    swa_cols: range  # page columns whose SWA_PAGE units travel (last step only)
    request_state: bool  # the REQ_SLOT units travel (last step only)

    @property
    def empty(self) -> bool:
        return not (self.full_cols or self.swa_cols or self.request_state)


def send_step(
    sent_cols: int, num_tokens: int, *, last: bool, page_size: int, retained_tokens: int
) -> SendStep:
    """The columns to send after prefill computed `num_tokens` tokens, `sent_cols` full
    columns having gone already."""
    if not last:
        return SendStep(range(sent_cols, max(sent_cols, num_tokens // page_size)), range(0), False)
    end = pages_for_tokens(num_tokens, page_size)
    tail = window_floor(num_tokens, page_size, retained_tokens) // page_size
    return SendStep(range(sent_cols, end), range(tail, end), True)


def tail_cols(num_tokens: int, page_size: int, retained_tokens: int) -> range:
    """The page columns decode preallocates SWA pages for (== the last step's `swa_cols`)."""
    return send_step(
        0, num_tokens, last=True, page_size=page_size, retained_tokens=retained_tokens
    ).swa_cols
