"""Quantized weights held as a DeepSeek-V4 checkpoint stores them, and their dequantization
into a caller's buffer (no I/O; `quant.py` has the formats' definitions and the quantizers).

    FP8Block   float8_e4m3fn [out, in] + one scale per `block` (E8M0 or float32 [gr, gc])
    FP4Packed  int8 [out, ceil(in/2)] (two e2m1 codes a byte, low nibble first)
               + one E8M0 scale per 32 values of a row [out, ceil(in/32)]

A plain tensor (BF16, F16, F32, F64, or an integer table) is held as itself. `row_offset` lets an
FP8Block be a row slice of a larger block grid (transformers' stacked gate_up experts split
into w1 and w3 where the split is not block aligned): weight row r uses scale row
(r + row_offset) // block_rows.

NOTE: dequantization is exact in float32/float64 (fp8 and e2m1 values times a power of two),
and in bfloat16 for E8M0 scales; with a float32 FP8 scale the product rounds once to bfloat16,
as quant.py's reference dequantizer rounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4_worker.model.quant import E2M1_MAGNITUDES, FP4_GROUP

_E2M1 = (*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES))
# Byte b -> (value of its low nibble, value of its high nibble), for one index_select a byte.
_PAIRS = torch.tensor([[_E2M1[b & 0xF], _E2M1[b >> 4]] for b in range(256)], dtype=torch.float64)
_pairs_cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _pairs(dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (dtype, device)
    table = _pairs_cache.get(key)
    if table is None:
        table = _pairs_cache[key] = _PAIRS.to(device=device, dtype=dtype)
    return table


@dataclass(frozen=True, slots=True, eq=False)
class FP8Block:
    """A block-scaled FP8 matrix [out, in]."""

    values: Tensor  # float8_e4m3fn [out, in]
    scale: Tensor  # float8_e8m0fnu or float32 [ceil((row_offset + out) / br), ceil(in / bc)]
    block: tuple[int, int]
    row_offset: int = 0

    def __post_init__(self) -> None:
        rows, cols = self.values.shape
        br, bc = self.block
        grid = (-(-(self.row_offset + rows) // br) - self.row_offset // br, -(-cols // bc))
        if self.values.dtype != torch.float8_e4m3fn or tuple(self.scale.shape) != grid:
            raise ValueError(
                f"FP8 block weight {tuple(self.values.shape)} {self.values.dtype} with scale "
                f"{tuple(self.scale.shape)}: expected float8_e4m3fn and a {grid} scale grid"
            )

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.values.shape
        return rows, cols

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    def dequantize_into(self, out: Tensor) -> Tensor:
        """value = fp8 x its block's scale, written into `out` [out, in] (a float dtype)."""
        if out.element_size() < 4 and self.scale.dtype != torch.float8_e8m0fnu:
            # A float32 scale is not exact in bfloat16: multiply exactly, round once.
            return out.copy_(self.dequantize_into(torch.empty_like(out, dtype=torch.float64)))
        rows, cols = self.values.shape
        br, bc = self.block
        out.copy_(self.values)
        s = self.scale.to(out.dtype)
        gc = s.shape[1]
        if self.row_offset == 0 and rows % br == 0 and cols % bc == 0:
            out.view(rows // br, br, gc, bc).mul_(s[:, None, :, None])
            return out
        first = self.row_offset // br
        rowmap = (torch.arange(rows, device=out.device) + self.row_offset) // br - first
        per_row = s.index_select(0, rowmap)  # [rows, gc]
        if cols % bc == 0:
            out.view(rows, gc, bc).mul_(per_row[:, :, None])
        else:
            out.mul_(per_row.repeat_interleave(bc, dim=1)[:, :cols])
        return out


@dataclass(frozen=True, slots=True, eq=False)
class FP4Packed:
    """Packed FP4 (e2m1) experts [out, cols] with E8M0 group scales."""

    packed: Tensor  # int8 [out, ceil(cols / 2)]
    scale: Tensor  # float8_e8m0fnu [out, ceil(cols / 32)]
    cols: int

    def __post_init__(self) -> None:
        rows, width = self.packed.shape
        grid = (rows, -(-self.cols // FP4_GROUP))
        ok = width == -(-self.cols // 2) and tuple(self.scale.shape) == grid
        if not ok or self.packed.element_size() != 1:
            raise ValueError(
                f"FP4 weight {tuple(self.packed.shape)} {self.packed.dtype} with scale "
                f"{tuple(self.scale.shape)}: expected bytes [{rows}, {-(-self.cols // 2)}] and "
                f"a {grid} scale grid for {self.cols} columns"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes

    def dequantize_into(self, out: Tensor) -> Tensor:
        """value = e2m1 x its group's scale, written into `out` [out, cols]."""
        rows, width = self.packed.shape
        codes = self.packed.view(torch.uint8).to(torch.int32).view(-1)
        table = _pairs(out.dtype, out.device)
        if self.cols == 2 * width:
            torch.index_select(table, 0, codes, out=out.view(rows * width, 2))
        else:  # an odd last column pairs with a padding nibble
            out.copy_(table.index_select(0, codes).view(rows, 2 * width)[:, : self.cols])
        s = self.scale.to(out.dtype)
        if self.cols % FP4_GROUP == 0:
            out.view(rows, -1, FP4_GROUP).mul_(s[:, :, None])
        else:
            out.mul_(s.repeat_interleave(FP4_GROUP, dim=1)[:, : self.cols])
        return out


Stored = Tensor | FP8Block | FP4Packed


def stored_nbytes(s: Stored) -> int:
    return s.nbytes


def stored_shape(s: Stored) -> tuple[int, ...]:
    return tuple(s.shape)


def fp8_row_slice(w: FP8Block, start: int, stop: int) -> FP8Block:
    """Rows [start, stop) of `w` as their own FP8Block (the scale rows they use, copied)."""
    br = w.block[0]
    offset = w.row_offset + start
    lo, hi = offset // br, -(-(w.row_offset + stop) // br)
    first = w.row_offset // br
    return FP8Block(
        w.values[start:stop].clone(),
        w.scale[lo - first : hi - first].clone(),
        w.block,
        offset % br,
    )


def pairs_equal(a: Stored, b: Stored) -> bool:
    """Same format and the same stored bytes (tests and checks)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, FP8Block) and isinstance(b, FP8Block):
        return (
            a.block == b.block
            and a.row_offset == b.row_offset
            and torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
            and a.scale.dtype == b.scale.dtype
            and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        )
    if isinstance(a, FP4Packed) and isinstance(b, FP4Packed):
        return (
            a.cols == b.cols
            and torch.equal(a.packed, b.packed)
            and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        )
    return False


__all__ = [
    "FP4Packed",
    "FP8Block",
    "Stored",
    "fp8_row_slice",
    "pairs_equal",
    "stored_nbytes",
    "stored_shape",
]
