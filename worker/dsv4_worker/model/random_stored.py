"""Seeded random weights held in the formats the planner counts (`dsv4_common.core.tensors`'s
`stored`: FP8 blocks with E8M0 scales, packed FP4 experts, BF16/F32 floats, I64 hash tables):
what `dsv4 serve` holds without a checkpoint (`--seed`, or a preset with no shipped weights).

An unquantized model's target parameters are `init_weights`'s values (float32 draws) in the
planner's dtypes, so a float32 model served from a seed holds exactly the oracle's values. A
quantized model's tensors are drawn in their stored form on the device, one generator per
tensor name (no float copy of the model ever exists): FP8 values N(0, 16^2) clamped to e4m3,
FP4 codes uniform over the 16 e2m1 codes, each with a power-of-two scale that makes the
weight's spread about 1/sqrt(fan-in). Pure apart from the tensors it makes.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

from dsv4_common.core import tensors as T
from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_worker.model.stored import FP4Packed, FP8Block, Stored
from dsv4_worker.model.weights import INTEGER_SUFFIXES, NORM_SUFFIXES, init_weights

TORCH_STORAGE: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
}
_FP8_SPREAD = 16.0  # std of the drawn e4m3 values (max 448)
_FP4_SPREAD = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # uniform codes


def random_weights(
    model: ModelConfig, seed: int, names: set[str], device: torch.device | str = "cpu"
) -> dict[str, Stored]:
    """The parameters `names` (a stage's, MTP layers included), seeded, held as stored."""
    if not isinstance(model, DSV4Config):  # the generic family: float32 (no storage spec)
        full = init_weights(model, seed, device, dtype=torch.float32)
        return {n: t for n, t in full.items() if n in names}
    out: dict[str, Stored] = {}
    plain = (
        init_weights(model, seed, device, dtype=torch.float32) if model.quantization is None else {}
    )
    for p in T.checkpoint_params(model):
        for name in p.names():
            if name not in names:
                continue
            stored = T.stored(model, p)
            value = plain.get(name)
            if value is not None and stored[0].dtype in TORCH_STORAGE:
                out[name] = value.to(TORCH_STORAGE[stored[0].dtype])
            else:
                out[name] = _draw(model, p, name, stored, _generator(seed, name, device))
    missing = sorted(names - set(out))
    if missing:
        raise ValueError(f"{model.name} has no parameters {missing[:5]}")
    return out


def _generator(seed: int, name: str, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=device)
    return gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _draw(
    model: DSV4Config,
    p: T.Param,
    name: str,
    stored: tuple[T.Tensor, ...],
    gen: torch.Generator,
) -> Stored:
    dev = gen.device
    weight = stored[0]
    if name.endswith(INTEGER_SUFFIXES):
        experts = model.weights.num_routed_experts
        draws = torch.rand(p.shape[0], experts, generator=gen, device=dev)
        return draws.argsort(dim=-1)[:, : p.shape[1]].to(TORCH_STORAGE[weight.dtype])
    if weight.dtype in ("BF16", "F16", "F32"):
        return _float(name, p.shape, gen).to(TORCH_STORAGE[weight.dtype])
    rows, cols = p.shape
    scale = stored[1]
    if weight.dtype == "F8_E4M3":
        values = torch.randn(rows, cols, generator=gen, device=dev) * _FP8_SPREAD
        q = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        s = _pow2_scale(scale.shape, _FP8_SPREAD * math.sqrt(cols), scale.dtype, dev)
        return FP8Block(q, s, (T.FP8_BLOCK, T.FP8_BLOCK))
    packed = torch.randint(-128, 128, weight.shape, generator=gen, device=dev, dtype=torch.int8)
    s = _pow2_scale(scale.shape, _FP4_SPREAD * math.sqrt(cols), scale.dtype, dev)
    return FP4Packed(packed, s, cols)


def _pow2_scale(shape: tuple[int, ...], spread: float, dtype: str, device: torch.device) -> Tensor:
    """A constant power-of-two scale 2^e ~ 1 / spread (E8M0 bytes, or float32)."""
    exp = round(-math.log2(spread))
    if dtype == "F32":
        return torch.full(shape, 2.0**exp, dtype=torch.float32, device=device)
    byte = torch.full(shape, exp + 127, dtype=torch.uint8, device=device)
    return byte.view(torch.float8_e8m0fnu)


def _float(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """A float parameter drawn as `init_weights` draws its kind (float32)."""
    dev = gen.device
    if name.endswith(NORM_SUFFIXES):
        return 1.0 + 0.2 * torch.randn(shape, generator=gen, device=dev)
    if name.endswith(("ape", "_base", "attn_sink", "gate.bias")):
        return torch.randn(shape, generator=gen, device=dev) * 0.5
    if name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=gen, device=dev)
    if name.endswith("embed.weight"):
        return torch.randn(shape, generator=gen, device=dev)
    gain = 4.0 if name == "head.weight" else 1.0
    return torch.randn(shape, generator=gen, device=dev) * (gain / math.sqrt(shape[-1]))
