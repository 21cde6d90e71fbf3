"""Vectorized (torch) forms of the index-space conversions in `core/index_space.py`.

Every function takes and returns int64 tensors on any device and must agree elementwise with its
scalar twin (a test checks this). Slot/page 0 means "none" in every space.
"""

from __future__ import annotations

import torch
from torch import Tensor


def full_page_of(slots: Tensor, page_size: int) -> Tensor:
    return torch.div(slots, page_size, rounding_mode="floor")


def full_slot_at(pages: Tensor, offsets: Tensor, page_size: int) -> Tensor:
    return pages * page_size + offsets


def swa_page_of(slots: Tensor, page_size: int) -> Tensor:
    return torch.div(slots, page_size, rounding_mode="floor")


def swa_slot_at(pages: Tensor, offsets: Tensor, page_size: int) -> Tensor:
    return pages * page_size + offsets


def compressed_row_of(slots: Tensor, ratio: int) -> Tensor:
    return torch.div(slots, ratio, rounding_mode="floor")


def completes_block(slots: Tensor, ratio: int) -> Tensor:
    return (slots + 1) % ratio == 0


def compressed_page_of(rows: Tensor, ratio: int, page_size: int) -> Tensor:
    return torch.div(rows, page_size // ratio, rounding_mode="floor")


def page_state_row(swa_slots: Tensor, page_size: int, ring_rows: int) -> Tensor:
    return swa_page_of(swa_slots, page_size) * ring_rows + swa_slots % ring_rows


def request_state_row(req_slots: Tensor, positions: Tensor, ring_rows: int) -> Tensor:
    return req_slots * ring_rows + positions % ring_rows


def pages_for_tokens(num_tokens: Tensor, page_size: int) -> Tensor:
    return torch.div(num_tokens + (page_size - 1), page_size, rounding_mode="floor")


def floor_to_page(num_tokens: Tensor, page_size: int) -> Tensor:
    return torch.div(num_tokens, page_size, rounding_mode="floor") * page_size


def full_to_swa_slots(full_slots: Tensor, full_to_swa_page: Tensor, page_size: int) -> Tensor:
    """SWA slot of each full slot through the per-page mapping.

    NOTE: a slot whose page has no SWA page yields exactly 0 (the "none" slot), never
    `0 * P + offset`, which would alias a row of the reserved SWA page 0.
    """
    swa_pages = full_to_swa_page[full_page_of(full_slots, page_size)]
    return torch.where(swa_pages > 0, swa_pages * page_size + full_slots % page_size, 0)
