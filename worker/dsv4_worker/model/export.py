"""Write a DeepSeek-V4 model directory in the published format, which `checkpoint.py` loads
back: config.json in the release's form, `model-0000i-of-0000n.safetensors` shards of about
equal bytes and `model.safetensors.index.json`. Tensors keep their published names, floats are
stored as one dtype, integers (the hash routing tables) as int64; nothing is quantized.
Side effects: writes files under the directory (and removes shards an earlier export left).

    name order in the shards   embed, hc_head_*, head, norm, then layer by layer, MTP last
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4_common.core.hf_dsv4 import release_config
from dsv4_common.core.model import DSV4Config, WeightDtype
from dsv4_worker.model.checkpoint_names import mtp_param_shapes
from dsv4_worker.model.weights import WeightsError, check_weights

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SHARD_PATTERN = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
FLOAT_DTYPES: dict[torch.dtype, WeightDtype] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
_SCOPED = re.compile(r"^(layers|mtp)\.(\d+)\.")


def write_model_dir(
    root: str | os.PathLike[str],
    model: DSV4Config,
    params: Mapping[str, torch.Tensor],
    *,
    shards: int = 2,
    dtype: torch.dtype = torch.float32,
) -> dict[str, str]:
    """Write `params` (every target parameter of `model`, optionally whole MTP layers
    `mtp.K.*`) to the directory `root` in at most `shards` files. config.json is
    `release_config(model)` with torch_dtype naming `dtype`, so that it describes the stored
    tensors. Returns the weight map (tensor name -> shard file)."""
    if model.quantization is not None:
        raise ValueError(
            f"model {model.name!r} is block-FP8 quantized; write_model_dir stores plain floats"
        )
    if dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise ValueError(f"dtype {dtype} is not a checkpoint float dtype ({names})")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    check_params(model, params)
    stored = {name: _stored(t, dtype) for name, t in params.items()}
    weight_map = plan_shards({n: t.nbytes for n, t in stored.items()}, shards)
    config = release_config(dataclasses.replace(model, weight_dtype=FLOAT_DTYPES[dtype]))
    # 1. Shards (stale ones from an earlier export first removed), 2. the index, 3. config.json.
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if SHARD_PATTERN.match(old.name) and old.name not in weight_map.values():
            old.unlink()
    for shard in sorted(set(weight_map.values())):
        part = {n: stored[n] for n in weight_map if weight_map[n] == shard}
        save_file(part, str(out / shard), metadata={"format": "pt"})
    total_bytes = sum(t.nbytes for t in stored.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return weight_map


def check_params(model: DSV4Config, params: Mapping[str, torch.Tensor]) -> None:
    """Every target parameter of `model` with its shape, plus only whole MTP layers."""
    mtp_shapes = mtp_param_shapes(model)
    target = {n: t for n, t in params.items() if not n.startswith("mtp.")}
    check_weights(model, target)
    mtp = {n: t for n, t in params.items() if n.startswith("mtp.")}
    unexpected = sorted(set(mtp) - set(mtp_shapes))
    if unexpected:
        raise WeightsError(f"{model.name} has no MTP parameters {unexpected[:5]}")
    scopes = {_scope(n) for n in mtp}
    missing = sorted(n for n in mtp_shapes if _scope(n) in scopes and n not in mtp)
    if missing:
        raise WeightsError(f"MTP layers are written whole: missing {missing[:5]}")
    for name, t in mtp.items():
        if tuple(t.shape) != mtp_shapes[name]:
            raise WeightsError(f"{name}: shape {tuple(t.shape)}, expected {mtp_shapes[name]}")


def plan_shards(sizes_bytes: Mapping[str, int], shards: int) -> dict[str, str]:
    """Tensor name -> shard file: names in shard order, cut into `shards` runs of about equal
    bytes (each tensor goes where its middle byte falls). Empty runs are dropped, so the files
    are numbered 1..n without gaps."""
    names = sorted(sizes_bytes, key=_order)
    total_bytes = max(sum(sizes_bytes.values()), 1)
    run_of: dict[str, int] = {}
    offset_bytes = 0
    for name in names:
        middle = offset_bytes + sizes_bytes[name] / 2
        run_of[name] = min(shards - 1, int(middle * shards // total_bytes))
        offset_bytes += sizes_bytes[name]
    used = sorted(set(run_of.values()))
    number = {run: i + 1 for i, run in enumerate(used)}
    return {n: f"model-{number[run_of[n]]:05d}-of-{len(used):05d}.safetensors" for n in names}


def _order(name: str) -> tuple[int, int, str]:
    match = _SCOPED.match(name)
    if match is None:
        return (0, 0, name)
    return (1 if match.group(1) == "layers" else 2, int(match.group(2)), name)


def _scope(name: str) -> str:
    return ".".join(name.split(".")[:2])


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    value = t.detach().cpu()
    value = value.to(dtype) if value.is_floating_point() else value.to(torch.int64)
    return value.contiguous()
