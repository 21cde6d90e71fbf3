"""Same-shaped weights (one layer's routed experts, one matrix of each) held as one stack with a
leading expert axis, so that a device selects experts by an index tensor (the routing's choice,
never read back to the host) and dequantizes only what it selected.

    Stack.of(weights)          the stack, or None where the weights cannot share one
    stack.views()              each weight as a view into the stack (held in place of the
                               originals: the same bytes, nothing held twice)
    stack.select_into(i, out)  the weights at `i` (an index tensor [M] or a slice of experts)
                               dequantized into `out` [M, rows, cols]

NOTE: selection gathers the stored bytes (FP4 codes and their E8M0 scales, FP8 values and their
block scales) and dequantizes them with the same code a single weight uses, so a selected
expert equals that expert read alone, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, cast

import torch
from torch import Tensor

from dsv4_worker.model.stored import FP4Packed, FP8Block, Stored

# Values a CPU dequantizes in one call: dequantization makes temporaries as large as its output
# (FP4 codes as int32, scales repeated), which a CPU's caches want small (one Flash expert,
# 8M values, dequantizes 1.8x faster alone than 32 at once). A device takes a selection whole.
CPU_PIECE_VALUES: Final = 1 << 22


@dataclass(frozen=True, slots=True, eq=False)
class Stack:
    """E weights [rows, cols] of one kind: plain floats (`scale` None), FP8 blocks or FP4."""

    values: Tensor  # [E, rows, cols] floats or float8_e4m3fn; [E, rows, ceil(cols / 2)] FP4 codes
    scale: Tensor | None  # FP8 [E, rows / br, ceil(cols / bc)]; FP4 [E, rows, ceil(cols / 32)]
    cols: int
    block: tuple[int, int] | None  # FP8's block; None for plain floats and FP4

    @classmethod
    def of(cls, weights: Sequence[Stored]) -> Stack | None:
        """`weights` stacked (copies), or None when they differ in kind, shape, dtype or
        device, are not 2-D float matrices, or are row slices of an FP8 block grid
        (`row_offset`)."""
        first = weights[0]
        if len({_layout(w) for w in weights}) != 1:
            return None
        if isinstance(first, FP4Packed):
            fp4 = cast(Sequence[FP4Packed], weights)
            values, scales = [w.packed for w in fp4], [w.scale for w in fp4]
            return cls(torch.stack(values), torch.stack(scales), first.cols, None)
        if isinstance(first, FP8Block):
            if first.row_offset:
                return None
            fp8 = cast(Sequence[FP8Block], weights)
            values, scales = [w.values for w in fp8], [w.scale for w in fp8]
            return cls(torch.stack(values), torch.stack(scales), first.shape[1], first.block)
        if first.dim() != 2 or not first.is_floating_point():
            return None
        return cls(torch.stack(list(cast(Sequence[Tensor], weights))), None, first.shape[1], None)

    @property
    def num(self) -> int:
        return self.values.shape[0]

    @property
    def rows(self) -> int:
        return self.values.shape[1]

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def views(self) -> list[Stored]:
        """Each weight as a view into the stack."""
        return [self._as_stored(e, e + 1, squeeze=True) for e in range(self.num)]

    def select_into(self, index: Tensor | slice, out: Tensor) -> Tensor:
        """The weights at `index` (a long tensor [M] on the stack's device, or a slice of
        experts) in `out`'s dtype, written into `out` [M, rows, cols]."""
        count = out.shape[0]
        piece = count
        if self.device.type == "cpu":
            piece = max(1, CPU_PIECE_VALUES // (self.rows * self.cols))
        first = index.indices(self.num)[0] if isinstance(index, slice) else 0
        for i in range(0, count, piece):
            stop = min(i + piece, count)
            if isinstance(index, slice):
                part = self._as_stored(first + i, first + stop, squeeze=False)
            else:
                part = self._gathered(index[i:stop])
            flat = out[i:stop].view(-1, self.cols)
            if isinstance(part, Tensor):
                flat.copy_(part.view(-1, self.cols))
            else:
                part.dequantize_into(flat)
        return out

    def _gathered(self, index: Tensor) -> Stored:
        values = self.values.index_select(0, index)
        if self.scale is None:
            return values
        return self._flat(values, self.scale.index_select(0, index))

    def _as_stored(self, lo: int, hi: int, *, squeeze: bool) -> Stored:
        values = self.values[lo:hi]
        scale = self.scale[lo:hi] if self.scale is not None else None
        if squeeze:
            values = values[0]
            if scale is None:
                return values
            scale = scale[0]
            if self.block is None:
                return FP4Packed(values, scale, self.cols)
            return FP8Block(values, scale, self.block)
        return values if scale is None else self._flat(values, scale)

    def _flat(self, values: Tensor, scale: Tensor) -> Stored:
        """Stacked stored parts [M, ...] as one 2-D weight [M * rows, cols]: an FP8 block's
        scale row repeated for each of its rows (blocks of one row), since an expert's last
        block row may be partial."""
        flat_values = values.reshape(-1, values.shape[-1])
        if self.block is None:
            return FP4Packed(flat_values, scale.reshape(-1, scale.shape[-1]), self.cols)
        block_rows, block_cols = self.block
        per_row = scale.repeat_interleave(block_rows, dim=1)[:, : self.rows]
        return FP8Block(flat_values, per_row.reshape(-1, scale.shape[-1]), (1, block_cols))


def _layout(w: Stored) -> tuple[object, ...]:
    """What weights must share to stack: kind, shapes, dtypes, device (and FP8's block grid)."""
    if isinstance(w, FP4Packed):
        return ("fp4", w.packed.shape, w.cols, w.scale.dtype, w.packed.device)
    if isinstance(w, FP8Block):
        grid = (w.block, w.row_offset, w.scale.shape, w.scale.dtype)
        return ("fp8", w.values.shape, *grid, w.values.device)
    return ("plain", w.shape, w.dtype, w.device)
