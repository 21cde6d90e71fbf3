"""HuggingFace `config.json` -> a model config (DeepSeek-V4 or generic hybrid SWA). Pure;
every malformed field raises ModelConfigError naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsv4_common.core.model import (
    MAX_LAYERS,
    DSV4Config,
    HybridSWAConfig,
    LayerType,
    ModelConfig,
    ModelConfigError,
    WeightShape,
)


def load_hf_config(path: Path) -> ModelConfig:
    """Read a HuggingFace `config.json` file."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read ({exc})") from exc
    return parse_hf_config(text, name=path.parent.name or path.stem, where=str(path))


def parse_hf_config(text: str, name: str, where: str = "config.json") -> ModelConfig:
    """A HuggingFace `config.json` given as text (a file's, a ConfigMap's); `where` names its
    origin in errors."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: expected a JSON object")
    return from_hf_config(raw, name=name)


def from_hf_config(raw: Mapping[str, Any], name: str) -> ModelConfig:
    """Build a config from a HuggingFace config dict (DSV4 if it has `compress_ratios`)."""
    if "compress_ratios" in raw or str(raw.get("model_type", "")).startswith("deepseek_v4"):
        return _dsv4_from_hf(raw, name)
    if "layer_types" in raw or "sliding_window_pattern" in raw:
        return _hybrid_from_hf(raw, name)
    raise ModelConfigError(
        "config.json is neither DeepSeek-V4 (no 'compress_ratios') nor hybrid-SWA "
        "(no 'layer_types' / 'sliding_window_pattern')"
    )


def _get(raw: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in raw:
        return raw[key]
    if default is None:
        raise ModelConfigError(f"config.json is missing required field '{key}'")
    return default


def _int(
    raw: Mapping[str, Any], key: str, default: int | None = None, minimum: int | None = None
) -> int:
    """An integer field; bounds are the config types' to check, except `minimum`, which guards
    arithmetic done here before the config exists."""
    value = _get(raw, key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"config.json field '{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ModelConfigError(f"config.json field '{key}' must be >= {minimum}, got {value}")
    return value


def _weights_from_hf(raw: Mapping[str, Any], quantized_experts: bool) -> WeightShape:
    routed = _int(raw, "n_routed_experts", 0)
    return WeightShape(
        hidden_size=_int(raw, "hidden_size"),
        vocab_size=_int(raw, "vocab_size"),
        num_attention_heads=_int(raw, "num_attention_heads"),
        intermediate_size=_int(raw, "intermediate_size", 0),
        num_dense_layers=_int(raw, "first_k_dense_replace", 0),
        num_routed_experts=routed,
        num_shared_experts=_int(raw, "n_shared_experts", 0),
        moe_intermediate_size=_int(raw, "moe_intermediate_size", 0),
        num_experts_per_token=_int(raw, "num_experts_per_tok", min(8, routed) if routed else 8),
        q_lora_rank=_int(raw, "q_lora_rank", 0),
        o_lora_rank=_int(raw, "o_lora_rank", 0),
        expert_bytes_per_param=(0.5 + 1 / 32) if quantized_experts else 2.0,
        dense_bytes_per_param=(1.0 + 1 / 128) if quantized_experts else 2.0,
    )


def _dsv4_from_hf(raw: Mapping[str, Any], name: str) -> DSV4Config:
    ratios = _get(raw, "compress_ratios")
    if not isinstance(ratios, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in ratios
    ):
        raise ModelConfigError("config.json field 'compress_ratios' must be a list of integers")
    kv_dtype = str(raw.get("kv_cache_dtype", "fp8_e4m3"))
    if kv_dtype not in ("fp8_e4m3", "bf16", "fp32"):
        raise ModelConfigError(f"config.json field 'kv_cache_dtype' has unknown value {kv_dtype!r}")
    fp8 = kv_dtype == "fp8_e4m3"
    return DSV4Config(
        name=name,
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        compress_ratios=tuple(ratios),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0),
        window_tokens=_int(raw, "window_size", 128)
        if "window_size" in raw
        else _int(raw, "sliding_window", 128),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
        index_head_dim=_int(raw, "index_head_dim", 128),
        index_n_heads=_int(raw, "index_n_heads", 64),
        index_topk=_int(raw, "index_topk", 512),
        kv_dtype=kv_dtype,  # type: ignore[arg-type]
        indexer_dtype="fp8" if fp8 else "bf16",
        state_dtype="fp32",
        weights=_weights_from_hf(raw, quantized_experts=fp8),
        max_position_embeddings=_int(raw, "max_position_embeddings", 1 << 20),
        kv_page_align_bytes=576 if fp8 else 1,
    )


def _hybrid_from_hf(raw: Mapping[str, Any], name: str) -> HybridSWAConfig:
    n_layers = _int(raw, "num_hidden_layers", minimum=1)
    if n_layers > MAX_LAYERS:
        raise ModelConfigError(
            f"config.json field 'num_hidden_layers' must be <= {MAX_LAYERS}, got {n_layers}"
        )
    if "layer_types" in raw:
        mapped = _layer_types(raw["layer_types"], n_layers)
    else:
        pattern = _int(raw, "sliding_window_pattern", minimum=1)  # every pattern-th layer is full
        mapped = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    heads = _int(raw, "num_attention_heads", minimum=1)
    if "head_dim" in raw:
        head_dim = _int(raw, "head_dim", minimum=1)
    else:
        hidden = _int(raw, "hidden_size", minimum=1)
        head_dim = hidden // heads
        if head_dim < 1:
            raise ModelConfigError(
                f"config.json: hidden_size {hidden} / num_attention_heads {heads} gives a head "
                "dimension of 0: set head_dim"
            )
    return HybridSWAConfig(
        name=name,
        layer_types=mapped,
        window_tokens=_int(raw, "sliding_window", minimum=1),
        num_key_value_heads=_int(raw, "num_key_value_heads", heads, minimum=1),
        head_dim=head_dim,
        v_head_dim=head_dim,
        kv_dtype="bf16",
        weights=_weights_from_hf(raw, quantized_experts=False),
        max_position_embeddings=_int(raw, "max_position_embeddings", 8192, minimum=1),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0),
    )


def _layer_types(types: object, n_layers: int) -> tuple[LayerType, ...]:
    """HF `layer_types` ("sliding_attention", "full_attention", ...) -> "sliding" | "full"."""
    if not isinstance(types, list):
        raise ModelConfigError("config.json field 'layer_types' must be a list")
    if len(types) != n_layers:
        raise ModelConfigError(
            f"config.json field 'layer_types' has {len(types)} entries but num_hidden_layers "
            f"is {n_layers}"
        )
    mapped: list[LayerType] = []
    for i, t in enumerate(types):
        if isinstance(t, str) and "sliding" in t:
            mapped.append("sliding")
        elif isinstance(t, str) and "full" in t:
            mapped.append("full")
        else:
            raise ModelConfigError(
                f"config.json field 'layer_types[{i}]' must name sliding or full attention "
                f"(e.g. 'sliding_attention', 'full_attention'), got {t!r}"
            )
    return tuple(mapped)
