"""Model configs shared by the model and engine tests (`import model_helpers`)."""

from __future__ import annotations

import dataclasses

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import tiny


def tiny_moe(experts_per_token: int = 2) -> DSV4Config:
    """tiny with `experts_per_token` of its 4 routed experts per token (+ 1 shared)."""
    weights = dataclasses.replace(tiny().weights, num_experts_per_token=experts_per_token)
    return dataclasses.replace(tiny(), weights=weights)
