"""Small DeepSeek-V4 models with the release's KV shapes for the fp8 KV tests
(`import release_support`): a model directory exactly as DeepSeek releases one (FP8 block
weights, FP4 experts, `quantization_config`, no `kv_cache_dtype` key), and Flash- or
Pro-shaped layers: the real KV dimensions (448 + 64 head, 128-wide indexer keys, window 128,
c4 / c128 as the release orders them) around a small hidden size, so they run on a CPU."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from checkpoint_writer import release_encode, save_sharded

from dsv4_common.core.hf_dsv4 import release_config
from dsv4_common.core.model import DSV4Config, Quantization, WeightShape
from dsv4_common.core.presets import deepseek_v4_flash, deepseek_v4_pro, tiny
from dsv4_worker.model.checkpoint_names import mtp_param_shapes
from dsv4_worker.model.weights import init_weights

RELEASE = Quantization(scale_fmt="ue8m0", expert_dtype="fp4")  # the release's storage
SMALL = WeightShape(
    hidden_size=64,
    vocab_size=256,
    num_attention_heads=4,
    intermediate_size=0,
    num_routed_experts=4,
    num_shared_experts=1,
    moe_intermediate_size=32,
    num_experts_per_token=2,
    q_lora_rank=32,
    o_lora_rank=16,
)


def fp8_kv(model: DSV4Config) -> DSV4Config:
    """`model` with the release's KV storage (what a config.json with quantization means)."""
    return dataclasses.replace(
        model, kv_dtype="fp8_e4m3", indexer_dtype="fp8", kv_page_align_bytes=576
    )


def shaped_layers(preset: str, num_layers: int = 4, index_topk: int = 16) -> DSV4Config:
    """The first `num_layers` layers of Flash or Pro: their KV shapes and ratio order, small
    weights (random), a top-k small enough that the indexer selects at a few hundred tokens."""
    real = deepseek_v4_flash() if preset == "flash" else deepseek_v4_pro()
    return dataclasses.replace(
        real,
        name=f"{preset}-shaped",
        num_hidden_layers=num_layers,
        compress_ratios=(*real.compress_ratios[:num_layers], 0),
        index_topk=index_topk,
        weights=SMALL,
        max_position_embeddings=4096,
        arch=dataclasses.replace(real.arch, o_groups=2, num_hash_layers=1),
    )


def release_model() -> DSV4Config:
    """`tiny` as DeepSeek would release it: fp8 KV (the config's default with quantization)."""
    return fp8_kv(dataclasses.replace(tiny(), name="released"))


def write_release_dir(root: Path, model: DSV4Config, seed: int) -> dict[str, torch.Tensor]:
    """A model directory in the release's form: every tensor stored as the planner's table
    says DeepSeek stores it (FP8 block matrices with E8M0 scales, FP4 routed experts, BF16
    floats, F32 where the release keeps F32, I64 hash table), sharded with an index, and
    config.json with quantization_config and no kv_cache_dtype. Returns the float64 weights
    it was made from."""
    stored = dataclasses.replace(model, quantization=RELEASE, weight_dtype="bf16")
    config = release_config(stored)
    assert "kv_cache_dtype" not in config and "quantization_config" in config
    gen = torch.Generator().manual_seed(seed + 1)
    mtp = {
        n: (torch.randn(s, generator=gen) / math.sqrt(s[-1])).to(torch.float64)
        for n, s in sorted(mtp_param_shapes(model).items())
    }
    weights = init_weights(model, seed=seed)
    save_sharded(root, release_encode(stored, weights | mtp), 2, config)
    return weights
