"""Model directories for the checkpoint tests (`import checkpoint_writer`): tensors in any
naming, stored the way the release stores them (quantized with our own quantizer), sharded over
N files with an index, plus a config.json."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from dsv4_common.core.hf_dsv4 import release_config
from dsv4_common.core.model import DSV4Config, ExpertDtype, Quantization
from dsv4_worker.model.quant import (
    dequantize_fp4,
    dequantize_fp8_block,
    quantize_fp4,
    quantize_fp8_block,
)

Quant = Literal["none", "fp8", "fp4"]  # fp4: routed experts FP4, other matrices FP8 (release)
Naming = Literal["published", "transformers"]  # how scales are named
Kind = Literal["none", "fp8", "fp4"]

_ROUTED = re.compile(r"experts\.(\d+\.w[123]\.weight|gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"\.(ffn|mlp)\.gate\.weight$")
_KEPT = ("embed", "head", "hc_", "_hc.", "ape", "position_bias", "weights_proj")


def quant_kind(name: str, t: torch.Tensor, quant: Quant) -> Kind:
    """Which format the release gives a tensor: matrices FP8, routed experts FP4 (or FP8);
    embeddings, head, router gates, hyper-connections and vectors stay floats."""
    if quant == "none" or t.ndim < 2 or not t.is_floating_point():
        return "none"
    if _ROUTED.search(name):
        return "fp4" if quant == "fp4" else "fp8"
    kept = _ROUTER.search(name) or any(k in name for k in _KEPT)
    return "none" if kept else "fp8"


def scale_name(name: str, naming: Naming) -> str:
    if naming == "published":
        return name.removesuffix(".weight") + ".scale"
    return name + "_scale_inv"  # `.weight` -> `.weight_scale_inv`, stacked -> `_scale_inv`


def encode(
    tensors: Mapping[str, torch.Tensor],
    *,
    quant: Quant = "none",
    naming: Naming = "published",
    pow2: bool = True,
    float_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The stored tensors: floats as `float_dtype`, integers as they are, quantized ones as a
    weight plus its scale (E8M0, or F32 FP8 scales when `pow2` is False)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        kind = quant_kind(name, t, quant)
        if kind == "none":
            keep = not t.is_floating_point() or t.element_size() == 1
            out[name] = t if keep else t.to(float_dtype)
            continue
        q, s = quantize_fp8_block(t, pow2=pow2) if kind == "fp8" else quantize_fp4(t)
        out[name], out[scale_name(name, naming)] = q, s
    return out


def decoded(
    tensors: Mapping[str, torch.Tensor],
    quant: Quant,
    *,
    pow2: bool = True,
    float_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """What a loader must return for `encode(tensors, ...)`, in float64: dequant(quant(x)),
    floats rounded to `float_dtype`, integers as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        kind = quant_kind(name, t, quant)
        if kind == "fp8":
            out[name] = dequantize_fp8_block(*quantize_fp8_block(t, pow2=pow2))
        elif kind == "fp4":
            out[name] = dequantize_fp4(*quantize_fp4(t), cols=t.shape[-1])
        else:
            floating = t.is_floating_point()
            out[name] = t.to(float_dtype).to(torch.float64) if floating else t
    return out


def _order(name: str) -> tuple[int, str]:
    """Shard order: globals first, then layer by layer, MTP layers last (as releases do)."""
    m = re.search(r"(layers|mtp)\.(\d+)\.", name)
    if m is None:
        return (-1, name)
    return (int(m.group(2)) + (10_000 if m.group(1) == "mtp" else 0), name)


def save_sharded(
    root: Path,
    stored: Mapping[str, torch.Tensor],
    shards: int | None,
    config: dict[str, Any],
    place: Callable[[str], int | None] | None = None,
) -> dict[str, str]:
    """Write the tensors into `shards` files of about equal bytes with an index (None: one
    model.safetensors, no index) and config.json; `place(name)` may pick a tensor's shard
    index instead. Returns the weight map."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    names = sorted(stored, key=_order)
    if shards is None:
        save_file({n: stored[n].contiguous() for n in names}, str(root / "model.safetensors"))
        return dict.fromkeys(names, "model.safetensors")
    total = sum(stored[n].nbytes for n in names)
    weight_map: dict[str, str] = {}
    acc = 0
    for n in names:
        index = min(shards - 1, acc * shards // max(total, 1))
        chosen = place(n) if place is not None else None
        index = index if chosen is None else chosen
        weight_map[n] = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        acc += stored[n].nbytes
    for shard in sorted(set(weight_map.values())):
        part = {n: stored[n].contiguous() for n in names if weight_map[n] == shard}
        save_file(part, str(root / shard))
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    return weight_map


def write_checkpoint(
    root: Path,
    tensors: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    *,
    quant: Quant = "none",
    naming: Naming = "published",
    pow2: bool = True,
    float_dtype: torch.dtype = torch.float32,
    shards: int | None = 3,
) -> dict[str, str]:
    stored = encode(tensors, quant=quant, naming=naming, pow2=pow2, float_dtype=float_dtype)
    return save_sharded(root, stored, shards, config)


def published_config(model: DSV4Config, quant: Quant = "none") -> dict[str, Any]:
    """config.json in the release's form for `model`, stored as `quant` says (block FP8 with
    E8M0 scales; routed experts FP4 for "fp4", FP8 for "fp8")."""
    if quant != "none":
        expert_dtype: ExpertDtype = "fp4" if quant == "fp4" else "fp8"
        storage = Quantization(scale_fmt="ue8m0", expert_dtype=expert_dtype)
        model = dataclasses.replace(model, quantization=storage)
    return release_config(model)


_RELEASE_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def release_encode(
    model: DSV4Config, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`tensors` (published names) stored tensor by tensor as the planner's table says the
    release stores them (`dsv4_common.core.tensors.stored`): FP8 with E8M0 (or F32) block
    scales, FP4 experts packed with E8M0 scales, floats in their kind's dtype, hash tables
    I64."""
    from dsv4_common.core import tensors as T

    kinds = {n: p for p in T.checkpoint_params(model) for n in p.names()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        weight, *scale = T.stored(model, kinds[name])
        if weight.dtype == "I64":
            out[name] = t.to(torch.int64)
        elif weight.dtype in _RELEASE_FLOATS:
            out[name] = t.to(_RELEASE_FLOATS[weight.dtype])
        elif weight.dtype == "F8_E4M3":
            pow2 = scale[0].dtype == "F8_E8M0"
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp8_block(
                t, pow2=pow2
            )
        else:
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp4(t)
    return out
