"""DeepSeek-V4 weight quantization formats: our own quantizers and dequantizers (pure torch, no
I/O). `checkpoint.py` dequantizes with these; tests write quantized checkpoints with them.

Formats, and where each fact comes from (read, not copied):
- FP8 block: values stored float8_e4m3fn (max 448), one scale per 128x128 block of the
  [out, in] weight (ceil-div grid, so edge blocks are partial); value = fp8 * scale of its block.
  The release stores the scale as `<name minus .weight>.scale`, F8_E8M0 (`quantization_config`
  {fmt e4m3, scale_fmt ue8m0, weight_block_size [128, 128]} of the published config.json);
  transformers and older FP8 checkpoints call it `.weight_scale_inv`, F8_E8M0 or F32, and
  multiply by it too (transformers 5.24 `integrations/finegrained_fp8.py`, `Fp8Dequantize`).
- E8M0: an unsigned power of two, byte b = 2**(b - 127), 255 = NaN (torch.float8_e8m0fnu).
  DeepSeek's quantizer rounds a block's scale up to a power of two, 2**ceil(log2(amax / max)),
  so that amax / scale <= max (release `inference/kernel.py`, `fast_round_scale`); ours too.
- FP4 (routed experts): e2m1 values, two per byte stored I8, shape [out, in/2], the low nibble
  the even element (in 2j) and the high nibble element 2j+1; one E8M0 scale per 32 values along
  the input dim, shape [out, in/32]. Code c: bit 3 the sign, bits 0-2 index the magnitudes
  (0, 0.5, 1, 1.5, 2, 3, 4, 6). Sources agree: the release's `inference/convert.py`
  (`FP4_TABLE`, `cast_e2m1fn_to_e4m3fn`: `low = x & 0x0F`, `high = x >> 4`, stacked low
  first; read in public copies of deepseek-ai/DeepSeek-V4-Flash), SGLang's
  `python/sglang/srt/layers/quantization/fp8.py` (`DSV4_DEQUANT_FP4_TABLE`, the same cast),
  and transformers 5.24 `Fp8Dequantize._unpack_fp4` (same table, low nibble first).
Our FP4 rounding is to the nearest value, ties to the even code (IEEE style).
"""

from __future__ import annotations

import itertools
from typing import Final

import torch

FP8_MAX: Final = 448.0
FP8_BLOCK: Final = (128, 128)
FP4_MAX: Final = 6.0
FP4_GROUP: Final = 32
E2M1_MAGNITUDES: Final = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_MIN_EXP: Final = -127
E8M0_MAX_EXP: Final = 127
F32_SMALLEST: Final = 2.0**-149  # the smallest positive float32 (a subnormal)

_E2M1_TABLE = torch.tensor([*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES)])
_E2M1_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(E2M1_MAGNITUDES)])


def pow2_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The smallest power of two s (within E8M0's range) with amax / s <= qmax, float64."""
    ratio = amax.to(torch.float64) / qmax
    tiny = torch.finfo(torch.float64).tiny
    exp = torch.ceil(torch.log2(ratio.clamp(min=tiny)))
    return torch.exp2(exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP))


def to_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (float) -> float8_e8m0fnu, byte = exponent + 127."""
    exp = torch.log2(scales.to(torch.float64))
    if not bool(torch.all(exp == torch.round(exp))):
        raise ValueError("E8M0 scales must be powers of two")
    return (exp + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale (float8_e8m0fnu or a float dtype) as float64 multipliers."""
    return scale.to(torch.float64)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pad_cols, pad_rows = cols - x.shape[-1], rows - x.shape[-2]
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows)) if pad_cols or pad_rows else x


def _grid(n: int, block: int) -> int:
    return -(-n // block)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, *, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (float8_e4m3fn [..., out, in], scale [..., ceil(out/bo), ceil(in/bi)]):
    E8M0 power-of-two scales, or float32 amax / 448 scales when `pow2` is False."""
    rows, cols = w.shape[-2:]
    br, bc = block
    gr, gc = _grid(rows, br), _grid(cols, bc)
    x = _pad_to(w.to(torch.float64), gr * br, gc * bc)
    blocks = x.reshape(*x.shape[:-2], gr, br, gc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    if pow2:
        scale = pow2_scales(amax, FP8_MAX)
    else:
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        # A block of subnormals (amax < 448 * 2**-149) would round its scale to 0 (and its
        # values to 0 / 0): the smallest float32 keeps it, its values <= 448 of it.
        scale = scale.to(torch.float32).clamp(min=F32_SMALLEST).to(torch.float64)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(x.shape)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return q, to_e8m0(scale) if pow2 else scale.to(torch.float32)


def _expand(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    s = scale_values(scale).repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    return s[..., :rows, :cols]


def dequantize_fp8_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float64,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """value = fp8 * its block's scale, as `dtype` (computed in float64, exact)."""
    rows, cols = q.shape[-2:]
    grid = (*q.shape[:-2], _grid(rows, block[0]), _grid(cols, block[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)}, expected {grid}")
    out = q.to(torch.float64) * _expand(scale, rows, cols, *block)
    return out.to(dtype)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (uint8) of each value in [-6, 6], ties to the even code."""
    mag = x.abs()
    mids = _E2M1_MIDPOINTS.to(torch.float64)
    code = torch.bucketize(mag, mids)  # mag <= mids[k] -> k: ties land on the lower code
    tie = (code < len(mids)) & (mag == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    code = code + tie.long()
    return (code + 8 * (x < 0).long()).to(torch.uint8)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (packed int8 [..., out, ceil(in/2)], E8M0 scale [..., out,
    ceil(in/group)]); an odd last element pairs with a zero nibble."""
    rows, cols = w.shape[-2:]
    groups = _grid(cols, group)
    x = _pad_to(w.to(torch.float64), rows, groups * group)
    grouped = x.reshape(*x.shape[:-1], groups, group)
    scale = pow2_scales(grouped.abs().amax(dim=-1), FP4_MAX)
    codes = _e2m1_codes((grouped / scale[..., None]).clamp(-FP4_MAX, FP4_MAX))
    codes = codes.reshape(x.shape)[..., : cols + cols % 2]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), to_e8m0(scale)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8/uint8 [..., n] -> the e2m1 values [..., 2n] (float64), low nibble first."""
    u = packed.view(torch.uint8).long()
    table = _E2M1_TABLE.to(torch.float64)
    values = torch.stack([table[u & 0xF], table[u >> 4]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float64,
    *,
    cols: int | None = None,
    group: int = FP4_GROUP,
) -> torch.Tensor:
    """value = e2m1 * its group's scale, [..., out, cols] (default cols: 2 * packed width)."""
    cols = 2 * packed.shape[-1] if cols is None else cols
    if not 2 * packed.shape[-1] - 1 <= cols <= 2 * packed.shape[-1]:
        raise ValueError(f"{cols} columns do not fit a packed width of {packed.shape[-1]}")
    rows = packed.shape[-2]
    grid = (*packed.shape[:-2], rows, _grid(cols, group))
    if tuple(scale.shape) != grid:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)}, expected {grid}")
    values = unpack_fp4(packed)[..., :cols]
    return (values * _expand(scale, rows, cols, 1, group)).to(dtype)


def fp8_error_bound(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per element |dequant(quant(w)) - w| bound: half an e4m3 ulp, 2**-4 relative for normal
    values and 2**-10 * scale below the smallest normal (2**-6 * scale)."""
    s = _expand(scale, w.shape[-2], w.shape[-1], *block)
    return 2.0**-4 * w.abs().to(torch.float64) + 2.0**-10 * s


def fp4_error_bound(w: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Per element bound: half the e2m1 spacing, at most 1/4 of |w| (above 1) or 1/4 scale."""
    s = _expand(scale, w.shape[-2], w.shape[-1], 1, group)
    return 0.25 * w.abs().to(torch.float64) + 0.25 * s
