"""Argument checks at the edges of the KV memory package. Pure: reads its inputs, writes nothing.

Index and count arguments come in as tensors of any integer dtype and leave as 1-D int64 on the
allocator's device, or raise InvalidArgument; ranges are checked before any tensor is indexed
(an out-of-range index is a device-side assert on CUDA) and before any int64 arithmetic.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from dsv4_worker.mem.errors import InvalidArgument

INT_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)


def resolve_device(device: torch.device | str) -> torch.device:
    """The device tensors created on `device` report ("cuda" -> "cuda:0"), for exact compares."""
    return torch.empty(0, device=device).device


def int64_vector(value: object, what: str, device: torch.device) -> Tensor:
    """`value` as a 1-D int64 tensor (converted from any integer dtype); checks metadata only,
    so it never syncs with the device.

    NOTE: the common case (a plain 1-D int64 tensor on `device`) costs four attribute reads and
    returns `value` itself; everything else takes the checked conversion below."""
    if (
        type(value) is Tensor
        and value.dtype is torch.int64
        and value.device == device
        and value.dim() == 1
    ):
        return value
    return _converted(value, what, device)


def _converted(value: object, what: str, device: torch.device) -> Tensor:
    if not isinstance(value, Tensor):
        raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in INT_DTYPES:
        raise InvalidArgument(f"{what} must have an integer dtype, got {value.dtype}")
    if value.device != device:
        raise InvalidArgument(f"{what} is on {value.device}, the allocator on {device}")
    if value.dim() != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {tuple(value.shape)}")
    return value.to(torch.int64)


def check_range(values: Tensor, lo: int, hi: int, what: str) -> None:
    """Raise InvalidArgument unless every value lies in lo..hi (one device sync)."""
    if values.numel() == 0:
        return
    if values.numel() == 1:  # one read, no reduction
        v = int(values)
        check_bounds(v, v, lo, hi, what)
        return
    if values.device.type == "cpu":  # no sync to share: two reads beat one stacked read
        low, high = torch.aminmax(values)
        vmin, vmax = int(low), int(high)
    else:
        vmin, vmax = torch.stack(torch.aminmax(values)).tolist()
    check_bounds(vmin, vmax, lo, hi, what)


def check_bounds(vmin: int, vmax: int, lo: int, hi: int, what: str) -> None:
    """`check_range` for a min and max the caller already fetched (to share one sync)."""
    if vmin < lo or vmax > hi:
        raise InvalidArgument(f"{what} must be in {lo}..{hi}, got {vmin if vmin < lo else vmax}")


def check_same_shape(what: str, first: Tensor, *others: Tensor) -> None:
    """Raise InvalidArgument unless the tensors pair up entry for entry."""
    if any(t.shape != first.shape for t in others):
        shapes = ", ".join(str(tuple(t.shape)) for t in (first, *others))
        raise InvalidArgument(f"{what}: one entry each expected, got shapes {shapes}")


def int_arg(value: object, what: str, lo: int, hi: int | None = None) -> int:
    """A Python int (anything with `__index__`, bool excluded) in lo..hi."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an int, got bool")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} must be an int, got {type(value).__name__}") from None
    if n < lo or (hi is not None and n > hi):
        raise InvalidArgument(f"{what} must be in {lo}..{'' if hi is None else hi}, got {n}")
    return n
