"""Model configs shared by the model and engine tests (`import model_helpers`)."""

from __future__ import annotations

import dataclasses

import torch

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import tiny


def tiny_moe(experts_per_token: int = 2) -> DSV4Config:
    """tiny with `experts_per_token` of its 4 routed experts per token (+ 1 shared)."""
    weights = dataclasses.replace(tiny().weights, num_experts_per_token=experts_per_token)
    return dataclasses.replace(tiny(), weights=weights)


def ulp_tolerance(reference: torch.Tensor, ulps: int = 64) -> float:
    """An absolute tolerance of `ulps` units in the last place of `reference`'s dtype at its
    largest magnitude, for floats that two computations reach with different shapes or batch
    compositions: a BLAS kernel's result for a row can depend on how many rows it computes
    with, and which kernel runs depends on the CPU (AVX-512 vs AVX2) and the thread count, so
    such values agree to the last few bits, never by contract to every bit. Anything a test
    means to detect (a leaked token, a wrong mask) must move them by orders of magnitude more."""
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    return ulps * torch.finfo(reference.dtype).eps * max(scale, 1.0)
