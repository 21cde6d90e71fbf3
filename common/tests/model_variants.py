"""Model variants the pinned layout and planner tests were hand-computed for
(`import model_variants`)."""

from __future__ import annotations

import dataclasses

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import tiny


def tiny_bf16() -> DSV4Config:
    """tiny with bf16 window/compressed KV and indexer keys (the preset stores fp32 so that it
    equals transformers' forward token for token; the byte arithmetic of these tests is for
    2-byte rows)."""
    return dataclasses.replace(tiny(), kv_dtype="bf16", indexer_dtype="bf16")
