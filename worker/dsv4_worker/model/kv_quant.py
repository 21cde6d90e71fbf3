"""How DeepSeek-V4's KV rows are stored when `kv_cache_dtype` is fp8_e4m3: the release's row
formats (SGLang's and FlashMLA's too), as pure tensor functions from float rows to bytes and
back, and the Hadamard rotation its indexer applies before quantizing. CPU and CUDA alike,
vectorized over rows. Where the bytes sit in a pool page is engine/kv_rows.py's business.

One row (n = qk_nope_head_dim, r = qk_rope_head_dim, d = index_head_dim):

    format       data bytes                    side bytes
    KVFp8        n e4m3 codes | r bf16 values  ceil(n / 64) ue8m0 exponents, padded (584 B
                                               in all for 448 / 64: 448 + 128 + 7 + 1)
    IndexerFp8   d e4m3 codes                  ceil(d / 128) fp32 scales (132 B for 128)

NOTE (rounding, as the release's act_quant and SGLang's store kernels do it): per block, the
scale is the block's |max| (floored at 1e-4, in float32) / 448 -- rounded up to a power of
two for KV (stored as its biased exponent, ue8m0), kept as fp32 for the indexer; values are
divided by it, clamped to +-448 and rounded to nearest-even e4m3. The rope tail rounds to
bf16. Decoding is exact: a code times its power of two or fp32 scale. `round_trip` is what a
row reads back as, so the naive oracle computes with exactly what the paged pools return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4_common.core.layout import ComponentKind
from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_worker.model.ops import stored

E4M3_MAX: Final = 448.0
AMAX_FLOOR: Final = 1e-4  # the release's act_quant and SGLang's store kernels
KV_BLOCK: Final = 64  # nope values per ue8m0 scale
INDEXER_BLOCK: Final = 128  # indexer key values per fp32 scale
ROW_ALIGN: Final = 8  # a KV row's bytes are padded to a multiple of this (583 -> 584)
FLOAT_DTYPES: Final = ("fp32", "bf16", "fp16")  # stored as they are (ops.stored rounds)


class RowFormat(Protocol):
    """A quantized row: `data_bytes` then `side_bytes` (scales) per row."""

    @property
    def data_bytes(self) -> int: ...

    @property
    def side_bytes(self) -> int: ...

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Float rows [N, dim] -> (data [N, data_bytes], side [N, side_bytes]) uint8."""
        ...

    def decode(self, data: Tensor, side: Tensor, dtype: torch.dtype) -> Tensor:
        """The inverse: rows [N, dim] of `dtype`."""
        ...


@dataclass(frozen=True, slots=True)
class KVFp8:
    """A window or compressed KV row: e4m3 nope values with one power-of-two scale per 64,
    the rope tail in bf16."""

    nope: int
    rope: int

    @property
    def num_scales(self) -> int:
        return -(-self.nope // KV_BLOCK)

    @property
    def data_bytes(self) -> int:
        return self.nope + 2 * self.rope

    @property
    def side_bytes(self) -> int:
        return _align_up(self.data_bytes + self.num_scales, ROW_ALIGN) - self.data_bytes

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        codes, exponents = _quantize_pow2(x[:, : self.nope].float(), KV_BLOCK)
        rope = x[:, self.nope :].to(torch.bfloat16).contiguous().view(torch.uint8)
        pad = self.side_bytes - self.num_scales
        side = F.pad(exponents, (0, pad)) if pad else exponents
        return torch.cat([codes, rope], dim=1), side

    def decode(self, data: Tensor, side: Tensor, dtype: torch.dtype) -> Tensor:
        scale = _pow2(side[:, : self.num_scales].to(torch.int32) - 127)
        out = torch.empty(len(data), self.nope + self.rope, dtype=dtype, device=data.device)
        out[:, : self.nope] = _dequantize(data[:, : self.nope], scale, KV_BLOCK)
        if self.rope:
            out[:, self.nope :] = data[:, self.nope :].contiguous().view(torch.bfloat16)
        return out


@dataclass(frozen=True, slots=True)
class IndexerFp8:
    """An indexer key row: e4m3 values with one fp32 scale per 128."""

    dim: int

    @property
    def num_scales(self) -> int:
        return -(-self.dim // INDEXER_BLOCK)

    @property
    def data_bytes(self) -> int:
        return self.dim

    @property
    def side_bytes(self) -> int:
        return 4 * self.num_scales

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        blocks = _blocks(x.float(), INDEXER_BLOCK)
        scale = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / E4M3_MAX
        codes = _e4m3(blocks / scale[..., None], self.dim)
        return codes, scale.contiguous().view(torch.uint8)

    def decode(self, data: Tensor, side: Tensor, dtype: torch.dtype) -> Tensor:
        scale = side.contiguous().view(torch.float32)
        return _dequantize(data, scale, INDEXER_BLOCK).to(dtype)


def round_trip(fmt: RowFormat, x: Tensor) -> Tensor:
    """Rows `x` [..., dim] as they read back from a pool of format `fmt` (in x's dtype)."""
    flat = x.reshape(-1, x.shape[-1])
    return fmt.decode(*fmt.encode(flat), x.dtype).view(x.shape)


def row_format(model: DSV4Config, kind: ComponentKind) -> RowFormat | None:
    """The quantized format of a DSV4 component's rows, or None when they are stored as plain
    floats of the component's dtype. Raises ValueError for a format the engine cannot hold."""
    if kind in (ComponentKind.WINDOW_KV, ComponentKind.COMPRESSED_KV):
        if model.kv_dtype == "fp8_e4m3":
            return KVFp8(model.qk_nope_head_dim, model.qk_rope_head_dim)
        return None
    if kind is ComponentKind.INDEXER_KEYS:
        if model.indexer_dtype == "fp8":
            return IndexerFp8(model.index_head_dim)
        if model.indexer_dtype == "fp4":
            raise ValueError(
                "indexer_dtype fp4 is not implemented (fp8, bf16 or fp32 indexer keys are)"
            )
    return None


def check_kv_formats(model: ModelConfig) -> None:
    """Raise ValueError (naming the setting) unless the engine can hold `model`'s KV rows."""
    if isinstance(model, DSV4Config):
        for kind in (ComponentKind.WINDOW_KV, ComponentKind.INDEXER_KEYS):
            row_format(model, kind)
    elif model.kv_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {model.kv_dtype}: fp8 rows exist for DeepSeek-V4 only; the hybrid "
            f"family stores {list(FLOAT_DTYPES)} rows"
        )


def stored_kv(model: DSV4Config, x: Tensor) -> Tensor:
    """Window or compressed KV rows as they read back from their pool."""
    fmt = row_format(model, ComponentKind.WINDOW_KV)
    return round_trip(fmt, x) if fmt is not None else stored(x, model.kv_dtype)


def stored_index_keys(model: DSV4Config, x: Tensor) -> Tensor:
    """Indexer key rows (already rotated where quantized) as they read back."""
    fmt = row_format(model, ComponentKind.INDEXER_KEYS)
    return round_trip(fmt, x) if fmt is not None else stored(x, model.indexer_dtype)


def quantized_index_keys(model: DSV4Config) -> bool:
    """Whether the indexer's keys are stored quantized, so its queries and keys are rotated."""
    return model.indexer_dtype in ("fp8", "fp4")


def hadamard(x: Tensor) -> Tensor:
    """x [..., d] times the orthonormal Sylvester-Hadamard matrix (blockwise over the largest
    power of two dividing d; all of d for the real 128). Dot products between rotated vectors
    equal the originals' (up to rounding); the rotation spreads outliers before fp8 rounding."""
    d = x.shape[-1]
    block = d & -d  # the largest power of two dividing d
    h = _hadamard_matrix(block, x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], d // block, block) @ h).reshape(x.shape)


@lru_cache(maxsize=16)
def _hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Built on `device` (no host-to-device copy: its first use may be inside a step)."""
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return (h / math.sqrt(n)).to(dtype)


# -- fp8 block arithmetic ----------------------------------------------------------------------


def _blocks(x: Tensor, block: int) -> Tensor:
    """[N, n] float32 -> [N, ceil(n / block), block], the last block zero-padded (zeros leave
    a block's |max| unchanged)."""
    n = x.shape[-1]
    pad = -n % block
    return (F.pad(x, (0, pad)) if pad else x).view(x.shape[0], -1, block)


def _quantize_pow2(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """[N, n] float32 -> (e4m3 codes [N, n], biased exponents [N, nb]) uint8."""
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    exponent = _ceil_log2(amax / E4M3_MAX)
    codes = _e4m3(blocks * _pow2(-exponent)[..., None], x.shape[-1])
    return codes, (exponent + 127).to(torch.uint8)


def _e4m3(scaled: Tensor, n: int) -> Tensor:
    """Scaled blocks [N, nb, block] -> e4m3 codes [N, n] uint8 (clamped, nearest-even)."""
    fp8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return fp8.view(torch.uint8).flatten(1)[:, :n]


def _dequantize(codes: Tensor, scale: Tensor, block: int) -> Tensor:
    """e4m3 codes [N, n] uint8 times their block's scale [N, nb] float32 -> [N, n] float32.
    The codes' values come from a 256-entry table (exact, as torch converts them): on CPU a
    gather is ~10x faster than torch's float8 -> float32 conversion."""
    n = codes.shape[-1]
    values = torch.take(_e4m3_table(codes.device), codes.to(torch.int64))
    return (_blocks(values, block) * scale[..., None]).flatten(1)[:, :n]


@lru_cache(maxsize=8)
def _e4m3_table(device: torch.device) -> Tensor:
    """The float32 value of every e4m3 byte (0x7f and 0xff are NaN), built on `device` (no
    host-to-device copy: its first use may be inside a step)."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


def _ceil_log2(x: Tensor) -> Tensor:
    """ceil(log2(x)) of positive normal float32 values, from their bits (exact at powers of
    two, as the kernels compute it)."""
    bits = x.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(exponent: Tensor) -> Tensor:
    """2 ** exponent as float32, built from the bits (exact for -126 <= exponent <= 127)."""
    return ((exponent + 127).to(torch.int32) << 23).view(torch.float32)


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align
