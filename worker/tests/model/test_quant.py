"""Our FP8-block and FP4 quantizers: dequant(quant(w)) within each format's error bound,
already-representable values round-trip exactly, partial edge blocks, the packed layout."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis.extra.numpy import arrays

from dsv4_worker.model.quant import (
    FP4_GROUP,
    FP8_BLOCK,
    dequantize_fp4,
    dequantize_fp8_block,
    fp4_error_bound,
    fp8_error_bound,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4,
)

# Finite float32 values over a wide range of magnitudes, zeros and subnormals included.
_VALUES = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False)


def _matrices(max_rows: int, max_cols: int) -> st.SearchStrategy[torch.Tensor]:
    shapes = st.tuples(st.integers(1, max_rows), st.integers(1, max_cols))
    return shapes.flatmap(lambda s: arrays(np.float32, s, elements=_VALUES)).map(
        lambda a: torch.from_numpy(a.copy()).to(torch.float64)
    )


def _scaled(w: torch.Tensor) -> torch.Tensor:
    """Rows of very different magnitudes, so blocks get different scales."""
    exps = torch.arange(w.shape[0], dtype=torch.float64).remainder(40) - 20
    return w * torch.exp2(exps)[:, None]


@settings(max_examples=40, deadline=None)
@given(_matrices(200, 300), st.booleans())
# A block of subnormals once got a float32 scale of 0 (amax / 448 underflowed).
@example(torch.tensor([[1.1755e-38]], dtype=torch.float64), False)
def test_fp8_dequant_of_quant_is_within_half_an_e4m3_step(w: torch.Tensor, pow2: bool) -> None:
    w = _scaled(w)
    q, scale = quantize_fp8_block(w, pow2=pow2)
    rows, cols = w.shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == (torch.float8_e8m0fnu if pow2 else torch.float32)
    assert scale.shape == (-(-rows // 128), -(-cols // 128))
    err = (dequantize_fp8_block(q, scale) - w).abs()
    # F32 scales (amax / 448) are not exact divisors: allow float32 rounding on top.
    slack = 0.0 if pow2 else 2.0**-20
    assert torch.all(err <= fp8_error_bound(w, scale, FP8_BLOCK) * (1 + slack))


@settings(max_examples=40, deadline=None)
@given(_matrices(40, 200))
def test_fp4_dequant_of_quant_is_within_half_an_e2m1_step(w: torch.Tensor) -> None:
    w = _scaled(w)
    packed, scale = quantize_fp4(w)
    rows, cols = w.shape
    assert packed.dtype == torch.int8 and packed.shape == (rows, -(-cols // 2))
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (rows, -(-cols // 32))
    err = (dequantize_fp4(packed, scale, cols=cols) - w).abs()
    assert torch.all(err <= fp4_error_bound(w, scale, FP4_GROUP))


@settings(max_examples=30, deadline=None)
@given(_matrices(200, 300))
def test_fp8_values_already_on_the_grid_round_trip_exactly(w: torch.Tensor) -> None:
    once = dequantize_fp8_block(*quantize_fp8_block(_scaled(w)))
    assert torch.equal(dequantize_fp8_block(*quantize_fp8_block(once)), once)


@settings(max_examples=30, deadline=None)
@given(_matrices(40, 200))
def test_fp4_values_already_on_the_grid_round_trip_exactly(w: torch.Tensor) -> None:
    cols = w.shape[1]
    once = dequantize_fp4(*quantize_fp4(_scaled(w)), cols=cols)
    assert torch.equal(dequantize_fp4(*quantize_fp4(once), cols=cols), once)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 140),
    st.integers(1, 140),
    st.data(),
)
def test_fp8_codes_times_a_power_of_two_are_exact(
    batch: int, rows: int, cols: int, data: st.DataObject
) -> None:
    """Any e4m3 code times its block's power of two, the block's largest code above 224,
    quantizes back to the same codes and scales (batched, like stacked experts)."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (batch, rows, cols), generator=gen, dtype=torch.uint8)
    codes = codes.view(torch.float8_e4m3fn).to(torch.float64)
    codes = torch.nan_to_num(codes, nan=0.0).clamp(-448, 448)
    codes[..., ::128, ::128] = 448.0  # fixes every block's scale
    exps = torch.randint(-30, 30, (batch, -(-rows // 128), -(-cols // 128)), generator=gen)
    scale = torch.exp2(exps.to(torch.float64))
    w = codes * scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    q, s = quantize_fp8_block(w)
    assert torch.equal(q.to(torch.float64), codes)
    assert torch.equal(s.to(torch.float64), scale)
    assert torch.equal(dequantize_fp8_block(q, s), w)


def test_fp4_nibble_order_and_value_table() -> None:
    """Byte 0x?? holds element 2j in its low nibble; codes 0-7 = 0, .5, 1, 1.5, 2, 3, 4, 6 and
    bit 3 the sign (DeepSeek's convert.py FP4_TABLE)."""
    packed = torch.tensor([[0x71, 0xF9, 0x08]], dtype=torch.uint8).view(torch.int8)
    assert unpack_fp4(packed).tolist() == [[0.5, 6.0, -0.5, -6.0, -0.0, 0.0]]
    w = torch.tensor([[0.5, 6.0, -0.5, -6.0, 0.0, 3.0, 1.5, -2.0]])
    q, s = quantize_fp4(w)
    assert s.view(torch.uint8).tolist() == [[127]]  # amax 6 -> scale 1
    assert q.view(torch.uint8).tolist() == [[0x71, 0xF9, 0x50, 0xC3]]


def test_fp4_rounds_to_nearest_with_ties_to_the_even_code() -> None:
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -5.0, 0.3]])
    got = dequantize_fp4(*quantize_fp4(w), cols=10)
    assert got.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0, 0.5]]


def test_e8m0_scales_are_powers_of_two_covering_the_block() -> None:
    w = torch.zeros(130, 260, dtype=torch.float64)
    w[0, 0], w[129, 259], w[5, 200] = 448.0 * 3, 1e-3, -7.0
    q, s = quantize_fp8_block(w)
    tiny = 2.0**-127  # an all-zero block gets the smallest E8M0 scale
    assert s.to(torch.float64).tolist() == [[4.0, 2.0**-6, tiny], [tiny, tiny, 2.0**-18]]
    # 1344 / 4 = 336 lies halfway between e4m3's 320 and 352: ties go to the even mantissa.
    assert dequantize_fp8_block(q, s)[0, 0] == 320.0 * 4


@pytest.mark.parametrize("bad", [(1, 2), (2, 3)])
def test_a_scale_grid_of_the_wrong_shape_is_refused(bad: tuple[int, int]) -> None:
    q, _ = quantize_fp8_block(torch.ones(130, 10))
    with pytest.raises(ValueError, match="FP8 scale shape"):
        dequantize_fp8_block(q, torch.ones(bad))
