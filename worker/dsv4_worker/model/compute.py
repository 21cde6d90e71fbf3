"""The compute dtype of the model's arithmetic (`--dtype`, the rank config's `model.dtype`):
bfloat16 on CUDA and float32 on CPU by default; float64 only when asked (the oracle tests).

It is a property of one engine (carried by its `Params`), never a global, and never decides
how anything is stored: weights stay as the checkpoint holds them, KV rows as the plan's
layout says. Pure.
"""

from __future__ import annotations

from typing import Final

import torch

from dsv4_common.api.names import COMPUTE_DTYPES, ComputeDtype

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
assert set(TORCH_DTYPES) == set(COMPUTE_DTYPES) - {"auto"}


def compute_dtype(name: ComputeDtype | str, device: torch.device | str) -> torch.dtype:
    """`name` on `device`: auto is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"compute dtype {name!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name `--dtype` takes for a compute dtype."""
    for name, d in TORCH_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} is not a compute dtype ({', '.join(TORCH_DTYPES)})")


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the parts the reference computes in float32 whatever the activations are
    (compressor pooling, router scores, hyper-connection mixes): float32, or float64 when the
    model computes in float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
