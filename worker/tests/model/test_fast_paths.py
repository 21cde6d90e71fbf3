"""The model's CPU fast paths compute what their plain forms compute: Sinkhorn in numpy, the
complex-product rope with remembered turns, the batched decode attention and compressor
pooling (the paged engine's per-token forms) against the per-segment ones."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import ulp_tolerance

from dsv4_worker.model import attention as A
from dsv4_worker.model import compressor as C
from dsv4_worker.model import hyper
from dsv4_worker.model.rope import rotate


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(1, 4),
    st.integers(1, 30),
    st.integers(0, 2**31),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_numpy_sinkhorn_equals_torch_to_a_few_ulps(
    tokens: int, hc: int, iters: int, seed: int, dtype: torch.dtype
) -> None:
    """The same operations in the same order, but numpy's and torch's reductions are different
    kernels (their summation order over the <= 4 terms may differ by CPU), so not bit for bit.
    Values are in (0, 1]; 8 ulps after up to 30 iterations is far below any real difference.
    The numpy form adds eps as the sum's first term (torch's last): an ulp more at most."""
    gen = torch.Generator().manual_seed(seed)
    comb = torch.softmax(torch.randn(tokens, hc, hc, generator=gen, dtype=dtype), -1)
    fast = hyper.sinkhorn(comb, iters, 1e-6)
    assert fast.dtype == dtype
    plain = hyper.sinkhorn(comb.clone().requires_grad_(True), iters, 1e-6).detach()
    torch.testing.assert_close(fast, plain, rtol=0, atol=ulp_tolerance(plain, ulps=8 * iters))


def _rotate_real(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """The rotation written out pair by pair (what the bf16 fallback computes)."""
    dims = 2 * len(freq)
    angles = positions.to(x.dtype)[:, None] * freq.to(x.dtype)[None, :]
    while angles.dim() < x.dim():
        angles = angles.unsqueeze(1)
    head, rot = x[..., : x.shape[-1] - dims], x[..., x.shape[-1] - dims :]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack(
        [even * angles.cos() - odd * angles.sin(), odd * angles.cos() + even * angles.sin()], -1
    )
    return torch.cat([head, out.flatten(-2)], dim=-1)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 7), st.sampled_from([(), (3,)]), st.integers(1, 8), st.integers(0, 2**31))
def test_complex_rope_equals_the_pairwise_rotation(
    tokens: int, heads: tuple[int, ...], half: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, *heads, 2 * half + 4, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 5000, (tokens,), generator=gen)
    freq = torch.rand(half, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, positions, freq), _rotate_real(x, positions, freq))
    again = rotate(x, positions, freq)  # remembered turns: the same answer
    torch.testing.assert_close(again, _rotate_real(x, positions, freq))
    back = rotate(again, positions, freq, inverse=True)
    torch.testing.assert_close(back, x)
    positions.add_(1)  # an in-place change must not reuse the remembered turns
    torch.testing.assert_close(rotate(x, positions, freq), _rotate_real(x, positions, freq))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31))
def test_per_token_attention_equals_per_token_attend(tokens: int, keys: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, 4, 8, generator=gen, dtype=torch.float64)
    kv = torch.randn(tokens, keys, 8, generator=gen, dtype=torch.float64)
    mask = torch.rand(tokens, keys, generator=gen) < 0.7
    mask[:, 0] = True
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    rows = A.attend_rows(q, kv, mask, sinks)
    for t in range(tokens):
        one = A.attend(q[t : t + 1], kv[t], mask[t : t + 1], sinks)
        torch.testing.assert_close(rows[t : t + 1], one)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.sampled_from([2, 4]), st.booleans(), st.integers(0, 2**31))
def test_pooling_many_blocks_equals_one_at_a_time(
    blocks: int, ratio: int, overlap: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = (4 if overlap else 2) * 6
    span = (2 if overlap else 1) * ratio
    rows = torch.randn(blocks, span, width, generator=gen, dtype=torch.float64)
    valid = torch.ones(blocks, span, dtype=torch.bool)
    if overlap:
        valid[0, :ratio] = False  # the first block has no previous block
    pooled = C.pool_blocks(rows, valid, overlap)
    for b in range(blocks):
        prev = rows[b, :ratio] if overlap and bool(valid[b, 0]) else None
        curr = rows[b, ratio:] if overlap else rows[b]
        torch.testing.assert_close(pooled[b], C.pool_block(prev, curr, overlap))


def test_a_bfloat16_rotation_is_the_float32_one_rounded() -> None:
    """bfloat16 activations (the CUDA compute dtype) rotate in float32: positions past 256 are
    not bfloat16 integers (257 would turn by 256's angle)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 16, generator=gen)
    positions = torch.tensor([3, 257, 1001, 65_537])
    freq = torch.rand(4, generator=gen, dtype=torch.float64)
    got = rotate(x.bfloat16(), positions, freq)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, rotate(x.bfloat16().float(), positions, freq).bfloat16())
