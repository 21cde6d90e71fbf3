"""`Params`: weights held as stored, read in the compute dtype. A quantized linear equals
the same product (`cpu_linear.linear`: F.linear, or its split over threads on a CPU) with the
dequantized weight (quant.py's reference dequantizers), for any shape: partial
blocks, row slices of a block grid (transformers' stacked experts), odd FP4 widths, E8M0 and
float32 scales; the scratch buffers are reused and never corrupt a result still in use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.model import cpu_linear
from dsv4_worker.model.compute import compute_dtype
from dsv4_worker.model.params import Params
from dsv4_worker.model.quant import (
    dequantize_fp4,
    dequantize_fp8_block,
    quantize_fp4,
    quantize_fp8_block,
)
from dsv4_worker.model.stored import FP4Packed, FP8Block, fp8_row_slice

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _w(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.3


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    pow2=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_an_fp8_linear_is_the_dequantized_linear(
    rows: int, cols: int, pow2: bool, dtype: torch.dtype
) -> None:
    q, s = quantize_fp8_block(_w(rows, cols, rows * cols), pow2=pow2)
    p = Params({"w": FP8Block(q, s, (128, 128))}, dtype)
    x = torch.randn(5, cols, dtype=torch.float64).to(dtype)
    dense = dequantize_fp8_block(q, s, dtype)
    # Same weight values, same shapes, same kernel: bit for bit.
    assert torch.equal(p.linear(x, "w"), cpu_linear.linear(x, dense))
    assert torch.equal(p.dense("w"), dense)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    rows=st.integers(2, 300),
    cols=st.integers(1, 200),
    cut=st.integers(1, 299),
    dtype=st.sampled_from(DTYPES),
)
def test_row_slices_of_an_fp8_grid_dequantize_to_the_rows_of_the_whole(
    rows: int, cols: int, cut: int, dtype: torch.dtype
) -> None:
    """transformers stacks w1 and w3 in one FP8 tensor whose blocks straddle the split."""
    cut = min(cut, rows - 1)
    q, s = quantize_fp8_block(_w(rows, cols, cut), pow2=True)
    whole = FP8Block(q, s, (128, 128))
    want = dequantize_fp8_block(q, s, torch.float64)
    for lo, hi in ((0, cut), (cut, rows)):
        part = fp8_row_slice(whole, lo, hi)
        got = part.dequantize_into(torch.empty(hi - lo, cols, dtype=torch.float64))
        assert torch.equal(got, want[lo:hi])
        # A slice of a slice lands on the same scale rows.
        if hi - lo > 1:
            inner = fp8_row_slice(part, 1, hi - lo)
            got = inner.dequantize_into(torch.empty(hi - lo - 1, cols, dtype=torch.float64))
            assert torch.equal(got, want[lo + 1 : hi])
    assert part.nbytes <= whole.nbytes


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(1, 64), cols=st.integers(1, 150), dtype=st.sampled_from(DTYPES))
def test_an_fp4_linear_is_the_dequantized_linear(rows: int, cols: int, dtype: torch.dtype) -> None:
    packed, s = quantize_fp4(_w(rows, cols, cols))
    p = Params({"w": FP4Packed(packed, s, cols)}, dtype)
    x = torch.randn(3, cols, dtype=torch.float64).to(dtype)
    dense = dequantize_fp4(packed, s, dtype, cols=cols)
    assert torch.equal(p.linear(x, "w"), cpu_linear.linear(x, dense))


def test_a_float_weight_of_another_dtype_is_cast_at_use_not_at_load() -> None:
    w = _w(8, 16, 0).to(torch.bfloat16)
    p = Params({"w": w, "v": torch.ones(16, dtype=torch.bfloat16)}, torch.float32)
    x = torch.randn(2, 16)
    assert torch.equal(p.linear(x, "w"), cpu_linear.linear(x, w.float()))
    assert p.held("w") is w and p.nbytes == w.nbytes + 32  # held as bf16
    assert p.vector("v").dtype == torch.float32


def test_dense_results_survive_linear_calls_until_the_next_dense() -> None:
    a, b, c = (quantize_fp8_block(_w(16, 16, s)) for s in range(3))
    p = Params(
        {n: FP8Block(*qs, (128, 128)) for n, qs in zip("abc", (a, b, c), strict=True)},
        torch.float32,
    )
    held = p.dense("a")
    want = held.clone()
    p.linear(torch.ones(1, 16), "b")  # linear's scratch is not dense's
    assert torch.equal(held, want)
    p.dense("c")  # the next dense reuses the buffer
    assert torch.equal(p.dense("a"), want)


def test_params_of_plain_tensors_computes_in_their_dtype() -> None:
    assert Params.of({"w": torch.zeros(2, 2, dtype=torch.float64)}).dtype == torch.float64
    mixed = {"w": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2)}
    assert Params.of(mixed).dtype == torch.float32
    assert Params.of(mixed, torch.float64).dtype == torch.float64


@pytest.mark.parametrize(
    ("name", "device", "want"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("float64", "cpu", torch.float64),
        ("bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_auto_is_bfloat16_on_cuda_and_float32_on_cpu(
    name: str, device: str, want: torch.dtype
) -> None:
    assert compute_dtype(name, device) == want


def test_an_unknown_compute_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="float16"):
        compute_dtype("float16", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantized_linears_on_cuda_match_the_dequantized_ones() -> None:
    """On the device, in bfloat16: an FP4 linear and a partial-block FP8 linear dequantize
    exactly as on the CPU; a 128-aligned FP8 linear takes the scaled FP8 matmul where the
    probe found one (activations quantized per 128 channels: within 3% of the output's
    scale), else the same dequantization."""
    from dsv4_worker.model import fp8_matmul

    dev = torch.device("cuda")
    x = torch.randn(7, 256, dtype=torch.float64)
    q, s = quantize_fp8_block(_w(384, 256, 1))
    packed, fs = quantize_fp4(_w(64, 256, 2))
    q2, s2 = quantize_fp8_block(_w(100, 256, 3))
    held = {
        "fp8": FP8Block(q.to(dev), s.to(dev), (128, 128)),
        "fp4": FP4Packed(packed.to(dev), fs.to(dev), 256),
        "partial": FP8Block(q2.to(dev), s2.to(dev), (128, 128)),
    }
    p = Params(held, torch.bfloat16)
    xb = x.to(dev, torch.bfloat16)
    want_fp4 = F.linear(xb, dequantize_fp4(packed, fs, torch.bfloat16, cols=256).to(dev))
    assert torch.equal(p.linear(xb, "fp4"), want_fp4)
    want_partial = F.linear(xb, dequantize_fp8_block(q2, s2, torch.bfloat16).to(dev))
    assert torch.equal(p.linear(xb, "partial"), want_partial)
    want = F.linear(x, dequantize_fp8_block(q, s, torch.float64)).to(dev)
    got = p.linear(xb, "fp8").double()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 3e-2
    print(fp8_matmul.probe_report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_wide_linear_weight_is_held_column_major_after_its_first_use(dtype: torch.dtype) -> None:
    wide, tall = _w(96, 32, 1).to(dtype), _w(32, 96, 2).to(dtype)
    p = Params({"wide": wide, "tall": tall}, dtype)
    x = torch.randn(3, 32, dtype=dtype)
    got = p.linear(x, "wide")
    torch.testing.assert_close(
        got, F.linear(x, wide), rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5
    )
    held = p.held("wide")
    assert held.shape == wide.shape and held.t().is_contiguous() and torch.equal(held, wide)
    assert p.nbytes == wide.nbytes + tall.nbytes  # the same bytes, not a second copy
    p.linear(torch.randn(3, 96, dtype=dtype), "tall")
    assert p.held("tall") is tall  # out <= in: the row-major layout reads faster
    # every other read of a laid-out weight gives what it gave before
    assert torch.equal(p.dense("wide"), wide)
    assert torch.equal(p.rows("wide", torch.tensor([5, 0])), wide[[5, 0]])
    torch.testing.assert_close(p.linear(x, "wide"), got, rtol=0, atol=0)


def test_what_params_keeps_is_made_outside_inference_mode() -> None:
    """The engine's forward runs in inference mode; the scratch buffers, layouts and stacks
    Params makes during it stay normal tensors, so a later forward outside inference mode (the
    oracle, export) may still write into them."""
    q, s = quantize_fp8_block(_w(64, 32, 3))
    held = {"q": FP8Block(q, s, (128, 128)), "wide": _w(96, 32, 1).float()}
    held |= {f"e{i}": _w(16, 32, 10 + i).float() for i in range(2)}
    p = Params(held, torch.float32)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        inside = [p.linear(x, "q"), p.linear(x, "wide")]
        assert p.stack(["e0", "e1"]) is not None
        experts = p.experts(["e0", "e1"], slice(0, 2)).clone()
    assert all(t.is_inference() for t in inside)
    kept = [p.held(n) for n in p.names() if isinstance(p.held(n), torch.Tensor)]
    assert not any(t.is_inference() for t in kept + list(p._scratch.values()))
    outside = [p.linear(x, "q"), p.linear(x, "wide")]  # writes into the same scratch
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))
    assert torch.equal(p.experts(["e0", "e1"], slice(0, 2)), experts)
