"""Argument checks at the edges of the KV memory package. Pure: reads its inputs, writes nothing.

Index and count arguments come in as host values (a 1-D numpy integer array, or a CPU tensor)
or as a tensor on the allocator's device, in any integer dtype, and leave as 1-D int64 numpy
arrays, or raise InvalidArgument. Host values cost nothing to check; a device tensor is read
back once (a device sync on CUDA, and under DSV4_EMULATE_DEVICE=1): hot paths pass host values.
"""

from __future__ import annotations

import operator

import numpy as np
import torch
from torch import Tensor

from dsv4_worker.mem.errors import InvalidArgument

I64 = np.int64
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


def host_ints(
    value: object, what: str, device: torch.device | None = None, *, shared: bool = True
) -> np.ndarray:
    """`value` as a 1-D int64 numpy array (converted from any integer dtype): a numpy array or a
    CPU tensor as it is, a tensor on `device` (None: the host only) read back, unless `shared`
    says that device's tensors are host memory (a CPU taking host shortcuts, `device.py`).

    NOTE: the common case (a 1-D int64 numpy array) returns `value` itself: callers only read
    their arguments."""
    if type(value) is np.ndarray and value.dtype == I64 and value.ndim == 1:
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise InvalidArgument(f"{what} must have an integer dtype, got {value.dtype}")
        if value.ndim != 1:
            raise InvalidArgument(f"{what} must be 1-D, got shape {value.shape}")
        return value.astype(I64)
    if not isinstance(value, Tensor):
        raise InvalidArgument(
            f"{what} must be a numpy array or a torch.Tensor, got {type(value).__name__}"
        )
    if value.dtype not in INT_DTYPES:
        raise InvalidArgument(f"{what} must have an integer dtype, got {value.dtype}")
    if value.dim() != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {tuple(value.shape)}")
    if device is not None and value.device == device and not shared:
        read: np.ndarray = value.cpu().numpy()  # device data: one read-back
    elif value.device.type == "cpu":
        read = value.numpy()
    else:
        where = "the host" if device is None else str(device)
        raise InvalidArgument(f"{what} is on {value.device}, expected {where}")
    return read.astype(I64, copy=False)


def check_bounds(vmin: int, vmax: int, lo: int, hi: int, what: str) -> None:
    """Raise InvalidArgument unless [vmin, vmax] lies in lo..hi."""
    if vmin < lo or vmax > hi:
        raise InvalidArgument(f"{what} must be in {lo}..{hi}, got {vmin if vmin < lo else vmax}")


def check_range(values: np.ndarray, lo: int, hi: int, what: str) -> None:
    """Raise InvalidArgument unless every value lies in lo..hi."""
    if values.size:
        check_bounds(int(values.min()), int(values.max()), lo, hi, what)


def check_same_shape(what: str, first: np.ndarray, *others: np.ndarray) -> None:
    """Raise InvalidArgument unless the arrays pair up entry for entry."""
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
