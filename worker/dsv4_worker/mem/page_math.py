"""PageMath: token <-> page arithmetic on int64 tensors for one page size. Pure, no state.

Shifts when the page size is a power of two (the common case), division otherwise; both agree
elementwise with `index.py` for non-negative inputs (a test checks this).
"""

from __future__ import annotations

import torch
from torch import Tensor


class PageMath:
    __slots__ = ("_mask_t", "_shift", "_shift_t", "page_size")

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.page_size = page_size
        self._shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        # 0-d CPU operands (usable with tensors of any device): a Python scalar operand costs
        # a conversion per call, about half the price of these small ops.
        self._shift_t = torch.tensor(max(self._shift, 0), dtype=torch.int64)
        self._mask_t = torch.tensor(page_size - 1, dtype=torch.int64)

    def div(self, x: Tensor) -> Tensor:
        """floor(x / P)."""
        if self._shift >= 0:
            return torch.bitwise_right_shift(x, self._shift_t)
        return torch.div(x, self.page_size, rounding_mode="floor")

    def mod(self, x: Tensor) -> Tensor:
        """x mod P, in 0..P-1."""
        if self._shift >= 0:
            return torch.bitwise_and(x, self._mask_t)
        return torch.remainder(x, self.page_size)

    def start(self, pages: Tensor) -> Tensor:
        """First slot of each page: page * P."""
        if self._shift >= 0:
            return torch.bitwise_left_shift(pages, self._shift_t)
        return pages * self.page_size

    def floor(self, x: Tensor) -> Tensor:
        """x rounded down to a page boundary."""
        return x - self.mod(x)

    def pages_for(self, num_tokens: Tensor) -> Tensor:
        """ceil(n / P); `num_tokens` must be <= int64 max - (P - 1) (callers bound it first)."""
        return self.div(num_tokens + (self.page_size - 1))
