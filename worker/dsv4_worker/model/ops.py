"""Tensor primitives of the reference models: RMS norm, the hybrid family's rotary embedding
(DSV4's is in rope.py), SwiGLU (with DSV4's optional clamp), and the rounding a value takes
when it is stored in a KV pool. One code path for CPU and CUDA.

NOTE: the models compute in the engine's compute dtype (`compute.py`: bfloat16 on CUDA, float32
on CPU, float64 for the oracle tests; it travels with the activations and `Params`, never as a
global) and round every value that is stored (window KV, compressed KV, indexer keys,
compressor state) to its pool dtype the moment it is produced, in the paged engine and the
naive oracle alike. In float64 the forward is batch-invariant in practice: different batch
shapes change results far below the pools' float32/bf16 precision, so the paged engine reads
back exactly the values the oracle computes; in float32 they agree within float32 rounding.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F

from dsv4_worker.model.params import Params

EPS: Final = 1e-6
ROPE_THETA: Final = 10_000.0  # the hybrid family's rope (DSV4's tables: rope.py)

STORAGE_DTYPES: Final[dict[str, torch.dtype]] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = EPS) -> torch.Tensor:
    """RMS norm over the last axis (no gain when `weight` is None), in x's dtype."""
    if weight is not None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope(x: torch.Tensor, positions: torch.Tensor, rope_dims: int, theta: float) -> torch.Tensor:
    """Rotate the last `rope_dims` channels of `x` [..., T, ..., D] by `positions` [T]
    (rotate-half form). `x`'s second-to-last axis may be heads: positions broadcast over it."""
    if rope_dims == 0:
        return x
    if x.dtype not in (torch.float32, torch.float64):  # positions past 256 are not bf16 integers
        return rope(x.float(), positions, rope_dims, theta).to(x.dtype)
    half = rope_dims // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=x.dtype) / half)
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]  # [T, half]
    while angles.dim() < x.dim():
        angles = angles.unsqueeze(-2)  # broadcast over head axes between T and D
    cos, sin = angles.cos(), angles.sin()
    head, rot = x[..., : x.shape[-1] - rope_dims], x[..., x.shape[-1] - rope_dims :]
    a, b = rot[..., :half], rot[..., half:]
    return torch.cat([head, a * cos - b * sin, b * cos + a * sin], dim=-1)


def swiglu(
    x: torch.Tensor, p: Params, gate: str, up: str, down: str, limit: float = 0.0
) -> torch.Tensor:
    """down(silu(gate x) * up x) with the named weights; `limit` > 0 clamps gate x from above
    and up x to [-limit, limit] first (DeepSeek-V4's SwiGLU clamp)."""
    return p.linear(gated(p.linear(x, gate), p.linear(x, up), limit), down)


def gated(g: torch.Tensor, u: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(g) * u, the SwiGLU's inner product of its gate and up projections `g` and `u`,
    with DeepSeek-V4's clamp when `limit` > 0 (g from above, u to [-limit, limit])."""
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def stored(x: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """`x` as it reads back from a float pool of `dtype_name` (fp8 rows: kv_quant)."""
    dtype = STORAGE_DTYPES.get(dtype_name)
    if dtype is None:
        raise NotImplementedError(
            f"stored() rounds to the float pool dtypes {sorted(STORAGE_DTYPES)}, not "
            f"{dtype_name!r}; quantized rows round through model/kv_quant.py"
        )
    return x.to(dtype).to(x.dtype)
