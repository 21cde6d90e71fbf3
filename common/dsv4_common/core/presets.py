"""The built-in model presets, by name, and `load_model_config` (a preset name or a
HuggingFace `config.json` path). Pure Python."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dsv4_common.core.hf import load_hf_config
from dsv4_common.core.model import (
    DSV4Arch,
    DSV4Config,
    HybridSWAConfig,
    ModelConfig,
    ModelConfigError,
    Quantization,
    WeightShape,
    YarnScaling,
)

# The published configs' YaRN (compressed layers' rope only) and storage: block-FP8 (E4M3,
# E8M0 scales per 128x128) dense weights, FP4 routed experts, BF16 where not quantized.
_YARN = YarnScaling(
    factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0
)
_RELEASE_STORAGE = Quantization(scale_fmt="ue8m0", weight_block_size=(128, 128), expert_dtype="fp4")


def _flash_ratios() -> tuple[int, ...]:
    # layers 0-1 window only, then even = 4 (CSA), odd = 128 (HCA); + one MTP entry.
    return (0, 0, *(4 if i % 2 == 0 else 128 for i in range(2, 43)), 0)


def _pro_ratios() -> tuple[int, ...]:
    # layers 0-1 = 128, then even = 4, odd = 128 up to layer 60; + one MTP entry.
    return (128, 128, *(4 if i % 2 == 0 else 128 for i in range(2, 61)), 0)


def deepseek_v4_flash() -> DSV4Config:
    """DeepSeek-V4-Flash as released (common/tests/data/deepseek-v4-flash/config.json)."""
    return DSV4Config(
        name="deepseek-v4-flash",
        num_hidden_layers=43,
        compress_ratios=_flash_ratios(),
        num_nextn_predict_layers=1,
        window_tokens=128,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        index_head_dim=128,
        index_n_heads=64,
        index_topk=512,
        kv_dtype="fp8_e4m3",
        indexer_dtype="fp8",
        state_dtype="fp32",
        weights=WeightShape(
            hidden_size=4096,
            vocab_size=129280,
            num_attention_heads=64,
            intermediate_size=0,
            num_dense_layers=0,
            num_routed_experts=256,
            num_shared_experts=1,
            moe_intermediate_size=2048,
            num_experts_per_token=6,
            q_lora_rank=1024,
            o_lora_rank=1024,
        ),
        max_position_embeddings=1_048_576,
        kv_page_align_bytes=576,
        arch=DSV4Arch(o_groups=8, routed_scaling_factor=1.5, rope_scaling=_YARN),
        quantization=_RELEASE_STORAGE,
    )


def deepseek_v4_pro() -> DSV4Config:
    """DeepSeek-V4-Pro as released (common/tests/data/deepseek-v4-pro/config.json)."""
    return DSV4Config(
        name="deepseek-v4-pro",
        num_hidden_layers=61,
        compress_ratios=_pro_ratios(),
        num_nextn_predict_layers=1,
        window_tokens=128,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        index_head_dim=128,
        index_n_heads=64,
        index_topk=1024,
        kv_dtype="fp8_e4m3",
        indexer_dtype="fp8",
        state_dtype="fp32",
        weights=WeightShape(
            hidden_size=7168,
            vocab_size=129280,
            num_attention_heads=128,
            intermediate_size=0,
            num_dense_layers=0,
            num_routed_experts=384,
            num_shared_experts=1,
            moe_intermediate_size=3072,
            num_experts_per_token=6,
            q_lora_rank=1536,
            o_lora_rank=1024,
        ),
        max_position_embeddings=1_048_576,
        kv_page_align_bytes=576,
        arch=DSV4Arch(o_groups=16, routed_scaling_factor=2.5, rope_scaling=_YARN),
        quantization=_RELEASE_STORAGE,
    )


def tiny() -> DSV4Config:
    """CPU-friendly DeepSeek-V4 (every architectural part, small): window 8, ratios {0, 4, 16},
    two residual streams, 4 routed experts (2 per token, the first layer hash-routed)."""
    return DSV4Config(
        name="tiny",
        num_hidden_layers=6,
        compress_ratios=(0, 4, 16, 4, 16, 4, 0),
        num_nextn_predict_layers=1,
        window_tokens=8,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        index_head_dim=16,
        index_n_heads=16,
        index_topk=8,
        kv_dtype="fp32",  # exact enough to equal transformers' forward token for token
        indexer_dtype="fp32",
        state_dtype="fp32",
        weights=WeightShape(
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
        ),
        max_position_embeddings=4096,
        arch=DSV4Arch(
            hc_mult=2,
            o_groups=2,
            num_hash_layers=1,
            routed_scaling_factor=1.5,
            rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=1024),
        ),
        weight_dtype="fp32",
    )


def hybrid_tiny() -> HybridSWAConfig:
    """CPU-friendly generic hybrid model: one full layer per three sliding layers (Gemma-style)."""
    return HybridSWAConfig(
        name="hybrid-tiny",
        layer_types=(
            "sliding",
            "sliding",
            "sliding",
            "full",
            "sliding",
            "sliding",
            "sliding",
            "full",
        ),
        window_tokens=16,
        num_key_value_heads=2,
        head_dim=16,
        v_head_dim=16,
        kv_dtype="bf16",
        weights=WeightShape(
            hidden_size=64,
            vocab_size=256,
            num_attention_heads=4,
            intermediate_size=128,
            dense_bytes_per_param=4.0,
            embedding_bytes_per_param=4.0,
        ),
        max_position_embeddings=4096,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "deepseek-v4-flash": deepseek_v4_flash,
    "deepseek-v4-pro": deepseek_v4_pro,
    "hybrid-tiny": hybrid_tiny,
}


def load_model_config(preset_or_path: str) -> ModelConfig:
    """A preset name, or a path to a HuggingFace `config.json` (file or its directory)."""
    if preset_or_path in PRESETS:
        return PRESETS[preset_or_path]()
    path = Path(preset_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(
                f"model directory '{preset_or_path}' has no config.json (a HuggingFace model "
                "directory holds config.json beside its safetensors weights)"
            )
    if not path.is_file():
        raise ModelConfigError(
            f"model '{preset_or_path}' is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor an existing config.json or model directory"
        )
    return load_hf_config(path)
