"""BatchScratch: reusable index tensors of one device for the allocators' batch operations.

Owns scratch only (iota / ones caches, a duplicate-detection tag row), never allocator state:
its contents between calls mean nothing, and no state snapshot needs to include it.
"""

from __future__ import annotations

import torch
from torch import Tensor


class BatchScratch:
    def __init__(self, num_tags: int, device: torch.device) -> None:
        i64 = torch.int64
        self.device = device
        self._tag = torch.zeros(num_tags, dtype=i64, device=device)  # one entry per index value
        self._iota = torch.arange(max(num_tags, 1024), dtype=i64, device=device)
        self._ones = torch.ones(max(num_tags, 1024), dtype=i64, device=device)
        # Views of batch sizes (n < num_tags) seen before: slicing costs as much as a small op.
        self._num_tags = num_tags
        self._iota_views: dict[int, Tensor] = {}
        self._ones_views: dict[int, Tensor] = {}

    def iota(self, n: int) -> Tensor:
        """0, 1, ..., n-1 (a view: do not write to it)."""
        view = self._iota_views.get(n)
        if view is not None:
            return view
        if n > self._iota.numel():
            self._iota = torch.arange(2 * n, dtype=torch.int64, device=self.device)
            self._iota_views.clear()
        view = self._iota[:n]
        if n < self._num_tags:
            self._iota_views[n] = view
        return view

    def ones(self, n: int) -> Tensor:
        """n ones (a view: do not write to it)."""
        view = self._ones_views.get(n)
        if view is not None:
            return view
        if n > self._ones.numel():
            self._ones = torch.ones(2 * n, dtype=torch.int64, device=self.device)
            self._ones_views.clear()
        view = self._ones[:n]
        if n < self._num_tags:
            self._ones_views[n] = view
        return view

    def runs(self, counts: Tensor, total: int) -> tuple[Tensor | None, Tensor]:
        """(batch index, index within its run) for runs of `counts`; `total == counts.sum()`.
        One run: the batch index is None (read per-request values with `per_item`)."""
        if counts.numel() == 1:
            return None, self.iota(total)
        batch = torch.repeat_interleave(counts, output_size=total)
        first = torch.cumsum(counts, 0) - counts
        return batch, self.iota(total) - first.index_select(0, batch)

    def unique(self, values: Tensor) -> bool:
        """True iff no value repeats; `values` must lie in 0..num_tags-1."""
        tag = self.iota(values.numel())
        self._tag.scatter_(0, values, tag)  # a repeated value keeps one of its tags
        return torch.equal(self._tag.index_select(0, values), tag)


def per_item(values: Tensor, batch: Tensor | None) -> Tensor:
    """`values[batch]` for `runs`' batch index; None (one run): `values`, which broadcasts."""
    return values if batch is None else values.index_select(0, batch)
