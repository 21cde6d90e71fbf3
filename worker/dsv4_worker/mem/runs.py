"""Runs of consecutive indices on the host (numpy): the batch operations' index arithmetic.
Pure; int64 arrays in and out."""

from __future__ import annotations

import numpy as np

I64 = np.int64


def runs(counts: np.ndarray, total: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(batch index, index within its run) for runs of `counts`; `total == counts.sum()`.
    One run: the batch index is None (read per-request values with `per_item`)."""
    if counts.size == 1:
        return None, np.arange(total, dtype=I64)
    batch = np.repeat(np.arange(counts.size, dtype=I64), counts)
    first = np.cumsum(counts) - counts
    return batch, np.arange(total, dtype=I64) - first[batch]


def per_item(values: np.ndarray, batch: np.ndarray | None) -> np.ndarray:
    """`values[batch]` for `runs`' batch index; None (one run): `values`, which broadcasts."""
    return values if batch is None else values[batch]


def pages_for(num_tokens: np.ndarray, page_size: int) -> np.ndarray:
    """ceil(n / P) of non-negative counts (callers bound them below int64 max - P first)."""
    return (num_tokens + (page_size - 1)) // page_size
