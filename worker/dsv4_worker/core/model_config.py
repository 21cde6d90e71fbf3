"""Model configurations (frozen): the DeepSeek-V4 family and a generic hybrid-SWA family.

Owns the shape facts the KV layout spec and the weight estimate need. Pure Python: no torch.
NOTE: `compress_ratios` may be longer than `num_hidden_layers`; the tail entries belong to the
MTP/NextN draft layers and are never target layers (`target_ratios` is the target slice).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

KVDtype = Literal["fp8_e4m3", "bf16", "fp32"]
StateDtype = Literal["fp32", "bf16"]
IndexerDtype = Literal["fp8", "fp4", "bf16"]

DTYPE_BYTES: Mapping[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8": 1,
    "uint8": 1,
}
ALLOWED_RATIOS = frozenset({0, 4, 16, 128})


class ModelConfigError(ValueError):
    """A model configuration is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class WeightShape:
    """What the weight estimate needs. Bytes per parameter are per storage class."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int  # dense MLP width (first_k_dense layers; generic family: every layer)
    num_dense_layers: int = 0  # DSV4: first_k_dense_replace; generic: ignored
    num_routed_experts: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    q_lora_rank: int = 0
    o_lora_rank: int = 0
    expert_bytes_per_param: float = 2.0  # DSV4 checkpoints: FP4 experts + block scales
    dense_bytes_per_param: float = 2.0  # attention / dense MLP / shared experts
    embedding_bytes_per_param: float = 2.0


@dataclass(frozen=True, slots=True)
class DSV4Config:
    """DeepSeek-V4-style model: every layer keeps a raw window; ratio>0 layers also compress."""

    name: str
    num_hidden_layers: int
    compress_ratios: tuple[int, ...]  # per layer; tail entries = MTP layers
    num_nextn_predict_layers: int
    window_tokens: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_n_heads: int
    index_topk: int
    kv_dtype: KVDtype
    indexer_dtype: IndexerDtype
    state_dtype: StateDtype
    weights: WeightShape
    max_position_embeddings: int
    sparse_ratio: int = 4  # the ratio whose layers use the lightning indexer + overlapped rings
    # Byte alignment of one page of a KV component (FlashMLA-style fp8 pages use 576 B).
    kv_page_align_bytes: int = 1
    family: Literal["dsv4"] = field(default="dsv4", init=False)

    def __post_init__(self) -> None:
        _require(self.num_hidden_layers >= 1, "num_hidden_layers", "must be >= 1")
        _require(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        n_ratios = len(self.compress_ratios)
        lo, hi = self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers
        _require(
            lo <= n_ratios <= hi,
            "compress_ratios",
            f"has {n_ratios} entries; expected {lo} (target layers) up to {hi} (+ MTP layers)",
        )
        bad = sorted({r for r in self.compress_ratios if r not in ALLOWED_RATIOS})
        _require(not bad, "compress_ratios", f"values {bad} not in {sorted(ALLOWED_RATIOS)}")
        _require(
            all(r == 0 for r in self.compress_ratios[self.num_hidden_layers :]),
            "compress_ratios",
            "MTP (tail) entries must be 0: draft layers keep only a window",
        )
        _require(self.window_tokens >= 1, "window_size", "must be >= 1")
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        _require(self.index_head_dim >= 1, "index_head_dim", "must be >= 1")
        _require(self.kv_page_align_bytes >= 1, "kv_page_align_bytes", "must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def target_ratios(self) -> tuple[int, ...]:
        """Ratios of the target layers only (the MTP tail sliced off)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def nonzero_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.target_ratios if r}))

    def draft_ratio(self, draft_index: int) -> int:
        i = self.num_hidden_layers + draft_index
        return self.compress_ratios[i] if i < len(self.compress_ratios) else 0


@dataclass(frozen=True, slots=True)
class HybridSWAConfig:
    """Generic hybrid model: interleaved full-attention and sliding-window MHA/GQA layers."""

    name: str
    layer_types: tuple[Literal["full", "sliding"], ...]
    window_tokens: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    kv_dtype: KVDtype
    weights: WeightShape
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0
    family: Literal["hybrid_swa"] = field(default="hybrid_swa", init=False)

    def __post_init__(self) -> None:
        _require(len(self.layer_types) >= 1, "layer_types", "must list at least one layer")
        bad = sorted({t for t in self.layer_types if t not in ("full", "sliding")})
        _require(not bad, "layer_types", f"values {bad} not in ['full', 'sliding']")
        _require(self.window_tokens >= 1, "sliding_window", "must be >= 1")
        _require(self.num_key_value_heads >= 1, "num_key_value_heads", "must be >= 1")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)


ModelConfig = DSV4Config | HybridSWAConfig


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ModelConfigError(f"model config field '{field_name}' {message}")


# ---------------------------------------------------------------------------------------------
# Presets


def _flash_ratios() -> tuple[int, ...]:
    # layers 0-1 window only, then even = 4 (CSA), odd = 128 (HCA); + one MTP entry.
    return (0, 0, *(4 if i % 2 == 0 else 128 for i in range(2, 43)), 0)


def _pro_ratios() -> tuple[int, ...]:
    # layers 0-1 = 128, then even = 4, odd = 128 up to layer 60; + one MTP entry.
    return (128, 128, *(4 if i % 2 == 0 else 128 for i in range(2, 61)), 0)


def deepseek_v4_flash() -> DSV4Config:
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
            q_lora_rank=1024,
            o_lora_rank=1024,
            expert_bytes_per_param=0.5 + 1 / 32,  # FP4 + one 1-byte scale per 32 values
            dense_bytes_per_param=1.0 + 1 / 128,  # FP8 + block scales
        ),
        max_position_embeddings=1_048_576,
        kv_page_align_bytes=576,
    )


def deepseek_v4_pro() -> DSV4Config:
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
            q_lora_rank=1536,
            o_lora_rank=1024,
            expert_bytes_per_param=0.5 + 1 / 32,
            dense_bytes_per_param=1.0 + 1 / 128,
        ),
        max_position_embeddings=1_048_576,
        kv_page_align_bytes=576,
    )


def tiny() -> DSV4Config:
    """CPU-friendly DSV4 shape for tests and the local runner (window 8, ratios {0, 4, 16})."""
    return DSV4Config(
        name="tiny",
        num_hidden_layers=6,
        compress_ratios=(0, 4, 16, 4, 16, 4, 0),
        num_nextn_predict_layers=1,
        window_tokens=8,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=8,
        kv_dtype="bf16",
        indexer_dtype="bf16",
        state_dtype="fp32",
        weights=WeightShape(
            hidden_size=64,
            vocab_size=256,
            num_attention_heads=4,
            intermediate_size=128,
            num_dense_layers=6,
            q_lora_rank=32,
            o_lora_rank=32,
            dense_bytes_per_param=4.0,
            embedding_bytes_per_param=4.0,
        ),
        max_position_embeddings=4096,
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


# ---------------------------------------------------------------------------------------------
# HuggingFace config.json loading


def load_model_config(preset_or_path: str) -> ModelConfig:
    """A preset name, or a path to a HuggingFace `config.json` (file or its directory)."""
    if preset_or_path in PRESETS:
        return PRESETS[preset_or_path]()
    path = Path(preset_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(
            f"model '{preset_or_path}' is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor an existing config.json path"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return from_hf_config(raw, name=path.parent.name or path.stem)


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


def _int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = _get(raw, key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"config.json field '{key}' must be an integer, got {value!r}")
    return value


def _weights_from_hf(raw: Mapping[str, Any], quantized_experts: bool) -> WeightShape:
    return WeightShape(
        hidden_size=_int(raw, "hidden_size"),
        vocab_size=_int(raw, "vocab_size"),
        num_attention_heads=_int(raw, "num_attention_heads"),
        intermediate_size=_int(raw, "intermediate_size", 0),
        num_dense_layers=_int(raw, "first_k_dense_replace", 0),
        num_routed_experts=_int(raw, "n_routed_experts", 0),
        num_shared_experts=_int(raw, "n_shared_experts", 0),
        moe_intermediate_size=_int(raw, "moe_intermediate_size", 0),
        q_lora_rank=_int(raw, "q_lora_rank", 0),
        o_lora_rank=_int(raw, "o_lora_rank", 0),
        expert_bytes_per_param=(0.5 + 1 / 32) if quantized_experts else 2.0,
        dense_bytes_per_param=(1.0 + 1 / 128) if quantized_experts else 2.0,
    )


def _dsv4_from_hf(raw: Mapping[str, Any], name: str) -> DSV4Config:
    ratios = _get(raw, "compress_ratios")
    if not isinstance(ratios, list) or not all(isinstance(r, int) for r in ratios):
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
    n_layers = _int(raw, "num_hidden_layers")
    if "layer_types" in raw:
        types = raw["layer_types"]
        if not isinstance(types, list):
            raise ModelConfigError("config.json field 'layer_types' must be a list")
        mapped = tuple("sliding" if "sliding" in str(t) else "full" for t in types)
    else:
        pattern = _int(raw, "sliding_window_pattern")  # every pattern-th layer is full
        mapped = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    heads = _int(raw, "num_attention_heads")
    head_dim = _int(raw, "head_dim", _int(raw, "hidden_size") // heads)
    return HybridSWAConfig(
        name=name,
        layer_types=mapped,  # type: ignore[arg-type]
        window_tokens=_int(raw, "sliding_window"),
        num_key_value_heads=_int(raw, "num_key_value_heads", heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        kv_dtype="bf16",
        weights=_weights_from_hf(raw, quantized_experts=False),
        max_position_embeddings=_int(raw, "max_position_embeddings", 8192),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0),
    )
