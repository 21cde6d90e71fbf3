"""Python ints from small int64 tensors (the allocator's checks and page counts). Pure.

On the CPU a read costs no device sync, so a reduction and a read beat one stacked read (which
builds a tensor per call); a one-element vector needs no reduction, and a short one is cheaper
as a Python list. Off the CPU each read is a sync: callers there stack what they need instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

SMALL = 16  # up to this many elements, tolist() and Python's min/max beat aminmax


def min_of(x: Tensor) -> int:
    """min of a non-empty vector."""
    return int(x) if x.numel() == 1 else int(x.min())


def max_of(x: Tensor) -> int:
    """max of a non-empty vector."""
    return int(x) if x.numel() == 1 else int(x.max())


def min_max(x: Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty vector."""
    if x.numel() <= SMALL:
        values = x.tolist()
        return min(values), max(values)
    lo, hi = torch.aminmax(x)
    return int(lo), int(hi)


def sum_of(x: Tensor) -> int:
    """sum of a non-empty vector."""
    return int(x) if x.numel() == 1 else int(x.sum())
