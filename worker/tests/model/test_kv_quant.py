"""The fp8 row formats (model/kv_quant.py): their bytes are the planner's row bytes, their
encoding is the release's (e4m3 codes with ue8m0 power-of-two scales per 64 nope values, the
rope tail in bf16; indexer keys with an fp32 scale per 128), decoding is exact, and a stored
row reads back within half an e4m3 step of what was written. The indexer's Hadamard rotation
is orthonormal."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_common.core.layout import ComponentKind, indexer_row_storage, kv_row_storage
from dsv4_common.core.presets import deepseek_v4_flash, hybrid_tiny, tiny
from dsv4_worker.model.kv_quant import (
    E4M3_MAX,
    IndexerFp8,
    KVFp8,
    check_kv_formats,
    hadamard,
    round_trip,
    row_format,
)

FLASH = deepseek_v4_flash()


def rows(n: int, dim: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=gen, dtype=torch.float64) * scale


def test_the_released_rows_are_584_and_132_bytes() -> None:
    kv = row_format(FLASH, ComponentKind.WINDOW_KV)
    assert kv == KVFp8(448, 64)
    assert (kv.data_bytes, kv.side_bytes) == (448 + 128, 7 + 1)
    indexer = row_format(FLASH, ComponentKind.INDEXER_KEYS)
    assert indexer == IndexerFp8(128)
    assert (indexer.data_bytes, indexer.side_bytes) == (128, 4)
    assert row_format(FLASH, ComponentKind.COMPRESSED_KV) == kv
    assert row_format(tiny(), ComponentKind.WINDOW_KV) is None  # fp32 rows, stored as floats


@settings(max_examples=60, deadline=None)
@given(nope=st.integers(1, 600), rope=st.integers(0, 40).map(lambda r: 2 * r))
def test_format_bytes_equal_the_layout_row_bytes(nope: int, rope: int) -> None:
    m = dataclasses.replace(
        tiny(), qk_nope_head_dim=nope, qk_rope_head_dim=rope, kv_dtype="fp8_e4m3"
    )
    fmt = row_format(m, ComponentKind.WINDOW_KV)
    assert fmt is not None
    assert fmt.data_bytes + fmt.side_bytes == kv_row_storage(m).elems


@pytest.mark.parametrize("dim", [16, 100, 128, 256, 300])
def test_indexer_format_bytes_equal_the_layout_row_bytes(dim: int) -> None:
    m = dataclasses.replace(tiny(), index_head_dim=dim, indexer_dtype="fp8")
    fmt = row_format(m, ComponentKind.INDEXER_KEYS)
    assert fmt is not None
    assert fmt.data_bytes + fmt.side_bytes == indexer_row_storage(m).elems


def test_kv_bytes_are_e4m3_codes_ue8m0_exponents_and_bf16_rope() -> None:
    fmt = KVFp8(448, 64)
    x = rows(6, 512, 0)
    x[1, :64] = 0.0  # an all-zero block takes the floor's scale
    x[2, 64:128] *= 1e-7  # a block below the floor
    data, side = fmt.encode(x)
    assert data.dtype == side.dtype == torch.uint8
    blocks = x[:, :448].float().view(6, 7, 64)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32)
    assert torch.equal(side[:, :7].to(torch.int32), exponent + 127)
    assert torch.equal(side[:, 7], torch.zeros(6, dtype=torch.uint8))  # the pad byte
    scaled = blocks / torch.exp2(exponent.double())[..., None].float()
    codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).view(6, 448)
    assert torch.equal(data[:, :448], codes)
    rope = x[:, 448:].to(torch.bfloat16)
    assert torch.equal(data[:, 448:].contiguous().view(torch.bfloat16), rope)


@settings(max_examples=60, deadline=None)
@given(
    nope=st.integers(1, 200),
    rope=st.integers(0, 16).map(lambda r: 2 * r),
    magnitude=st.sampled_from([1e-9, 1e-3, 1.0, 300.0, 1e6]),
    seed=st.integers(0, 2**16),
)
def test_a_kv_row_reads_back_within_half_an_e4m3_step(
    nope: int, rope: int, magnitude: float, seed: int
) -> None:
    fmt = KVFp8(nope, rope)
    x = rows(5, nope + rope, seed, magnitude)
    y = round_trip(fmt, x)
    assert y.dtype == x.dtype and y.shape == x.shape
    padded = torch.nn.functional.pad(x[:, :nope], (0, -nope % 64)).view(5, -1, 64)
    amax = padded.abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: half a step is <= 2**-4 of the block's |max| (plus the
    # scale floor's subnormal step for blocks near zero)
    bound = (amax * 2**-4 + 2**-9 * 1e-4 / 448 * 2).expand_as(padded).reshape(5, -1)[:, :nope]
    assert bool(((y[:, :nope] - x[:, :nope]).abs() <= bound).all())
    assert torch.equal(y[:, nope:], x[:, nope:].to(torch.bfloat16).to(x.dtype))
    assert torch.equal(round_trip(fmt, y), y)  # what was read back stores unchanged


def test_zero_bytes_read_back_as_zero_rows() -> None:
    """A cleared unit (zero bytes) decodes to zeros, never NaN."""
    formats: list[tuple[KVFp8 | IndexerFp8, int]] = [(KVFp8(448, 64), 512), (IndexerFp8(128), 128)]
    for fmt, dim in formats:
        data = torch.zeros(3, fmt.data_bytes, dtype=torch.uint8)
        side = torch.zeros(3, fmt.side_bytes, dtype=torch.uint8)
        assert torch.equal(fmt.decode(data, side, torch.float32), torch.zeros(3, dim))


@pytest.mark.parametrize("dim", [128, 100])
def test_indexer_rows_carry_an_fp32_scale_per_128(dim: int) -> None:
    fmt = IndexerFp8(dim)
    x = rows(4, dim, 1).float()
    _, side = fmt.encode(x)
    scale = side.contiguous().view(torch.float32)
    assert scale.shape == (4, -(-dim // 128))
    assert torch.equal(scale[:, 0], x[:, :128].abs().amax(-1).clamp_min(1e-4) / 448)
    y = round_trip(fmt, x)
    assert bool(((y - x).abs() <= x.abs().amax(-1, keepdim=True) * 2**-4).all())


@pytest.mark.parametrize("dim", [128, 16, 96])
def test_hadamard_is_orthonormal_and_keeps_dot_products(dim: int) -> None:
    x = rows(8, dim, 2)
    h = hadamard(torch.eye(dim, dtype=torch.float64))
    assert torch.allclose(h @ h.T, torch.eye(dim, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(hadamard(x) @ hadamard(x).T, x @ x.T, atol=1e-9)
    assert not torch.allclose(hadamard(x), x)


def test_hadamard_spreads_an_outlier_over_the_block() -> None:
    x = torch.zeros(1, 128, dtype=torch.float64)
    x[0, 5] = 1.0
    assert torch.allclose(hadamard(x).abs(), torch.full((1, 128), 128**-0.5, dtype=torch.float64))


def test_formats_the_engine_cannot_hold_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="indexer_dtype fp4"):
        check_kv_formats(dataclasses.replace(FLASH, indexer_dtype="fp4"))
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3: fp8 rows exist for"):
        check_kv_formats(dataclasses.replace(hybrid_tiny(), kv_dtype="fp8_e4m3"))
    for model in (FLASH, tiny(), hybrid_tiny()):
        check_kv_formats(model)
