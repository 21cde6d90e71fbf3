"""Model configs shared by the model and engine tests (`import model_helpers`)."""

from __future__ import annotations

import dataclasses

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import tiny


def tiny_moe(experts_per_token: int = 2) -> DSV4Config:
    """tiny with two dense layers, then MoE: 4 routed experts (top-k) + 1 shared."""
    weights = dataclasses.replace(
        tiny().weights,
        num_dense_layers=2,
        num_routed_experts=4,
        num_shared_experts=1,
        moe_intermediate_size=32,
        num_experts_per_token=experts_per_token,
    )
    return dataclasses.replace(tiny(), weights=weights)
