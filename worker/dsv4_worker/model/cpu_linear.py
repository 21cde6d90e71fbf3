"""x @ W.T on a CPU, spread over torch's threads when x has few rows.

MKL multiplies a few rows by W [out, in] (a decode step's shape) on one thread, whatever
torch's thread count: on the 2-core EPYC it streams W from memory at 13-15 GB/s where two
threads stream 19-25. `linear` cuts W's out dimension into one part per thread (views, no copy,
in either memory layout) and multiplies the parts as one batched product, whose items torch
runs on separate threads: the same dot products, 1.15-1.7x faster at 1 row and 0.95-1.27x at
16 on medium's shapes (bench/layout.py, "split" column); from 64 rows one product already keeps
every thread busy.

Invariant: the result equals F.linear(x, w) within float rounding (each output is the same
dot product; only the kernel summing it differs), with x's shape and dtype.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F
from torch import Tensor

SPLIT_MAX_ROWS: Final = 32  # from 64 rows on, MKL's one product uses every thread
# below this a part's memory read costs less than handing it to a thread (on the 2-core EPYC
# parts of 128 KiB gained nothing, parts of 16 KiB took 3x as long as the plain product)
SPLIT_MIN_PART_BYTES: Final = 256 << 10


def parts(rows: int, out_features: int, w_bytes: int, threads: int, device: torch.device) -> int:
    """How many row blocks of W [out_features, in] (`w_bytes` in all) `linear` multiplies side
    by side for an x of `rows` rows: one per thread on a CPU when that divides W into parts of
    at least SPLIT_MIN_PART_BYTES and x is a few rows, else 1 (the plain product)."""
    if device.type != "cpu" or threads < 2 or not 0 < rows <= SPLIT_MAX_ROWS:
        return 1
    if out_features % threads or w_bytes // threads < SPLIT_MIN_PART_BYTES:
        return 1
    return threads


def linear(x: Tensor, w: Tensor, cache: dict[str, Tensor] | None = None, name: str = "") -> Tensor:
    """x [..., in] @ w.T [in, out] (w 2-D, in x's dtype), split over torch's threads when
    `parts` says so; `cache` (when given) keeps w's blocks under `name` for the next call
    (the caller drops the entry when it replaces w)."""
    w_bytes = w.nbytes
    if w_bytes < 2 * SPLIT_MIN_PART_BYTES:  # too small to split: a quick exit
        return F.linear(x, w)
    in_features, out_features = x.shape[-1], w.shape[0]
    rows = x.numel() // in_features if in_features else 0
    count = parts(rows, out_features, w_bytes, torch.get_num_threads(), w.device)
    if count == 1:
        return F.linear(x, w)
    blocks = cache.get(name) if cache is not None else None
    if blocks is None or blocks.shape[0] != count:
        blocks = w.view(count, out_features // count, w.shape[1]).transpose(1, 2)
        if cache is not None:
            cache[name] = blocks  # [count, in, out/count]: views of w
    flat = x.reshape(rows, in_features)
    out = torch.bmm(flat.expand(count, rows, in_features), blocks)  # [count, rows, out/count]
    if rows == 1:  # [count, 1, out/count] is [1, out] in memory
        return out.view(*x.shape[:-1], out_features)
    return out.transpose(0, 1).reshape(*x.shape[:-1], out_features)
