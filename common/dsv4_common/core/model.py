"""Model configuration types (frozen) and their validation: the DeepSeek-V4 family and a
generic hybrid-SWA family. Presets live in `presets.py`, HuggingFace loading in `hf.py`.

Owns the shape facts the KV layout spec and the weight estimate need. Pure Python: no torch.
NOTE: `compress_ratios` may be longer than `num_hidden_layers`; the tail entries belong to the
MTP/NextN draft layers and are never target layers (`target_ratios` is the target slice).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

KVDtype = Literal["fp8_e4m3", "bf16", "fp32"]
ScoringFunc = Literal["sqrtsoftplus", "softmax", "sigmoid"]
StateDtype = Literal["fp32", "bf16"]
IndexerDtype = Literal["fp8", "fp4", "bf16", "fp32"]
LayerType = Literal["full", "sliding"]
WeightDtype = Literal["bf16", "fp16", "fp32"]  # config.json's torch_dtype
ScaleFmt = Literal["ue8m0", "float"]  # FP8 block scales: 1-byte E8M0 or float32
ExpertDtype = Literal["fp4", "fp8"]

DTYPE_BYTES: Mapping[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8_e4m3": 1,
    "fp8": 1,
    "uint8": 1,
}
ALLOWED_RATIOS = frozenset({0, 4, 16, 128})
# Sanity bound on every count and dimension: far above any real model, low enough that the
# planner's arithmetic (bytes = products of a few of these) stays exact and finite.
MAX_DIM = 1 << 24
MAX_LAYERS = 4096
MAX_POSITIONS = 1 << 30


class ModelConfigError(ValueError):
    """A model configuration is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class WeightShape:
    """What the weight estimate needs. The bytes per parameter are the generic (hybrid)
    family's; a DeepSeek-V4 config is counted per tensor (`tensors.py`) from its
    `quantization` and `weight_dtype` instead."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int  # dense MLP width (first_k_dense layers; generic family: every layer)
    num_dense_layers: int = 0  # DSV4: first_k_dense_replace; generic: ignored
    num_routed_experts: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_token: int = 8  # routed experts each token uses (top-k of the router)
    q_lora_rank: int = 0
    o_lora_rank: int = 0
    dense_bytes_per_param: float = 2.0  # generic family only: attention, MLP
    embedding_bytes_per_param: float = 2.0  # generic family only: embedding, LM head

    def __post_init__(self) -> None:
        for name, minimum in (
            ("hidden_size", 1),
            ("vocab_size", 1),
            ("num_attention_heads", 1),
            ("intermediate_size", 0),
            ("num_dense_layers", 0),
            ("num_routed_experts", 0),
            ("num_shared_experts", 0),
            ("moe_intermediate_size", 0),
            ("num_experts_per_token", 1),
            ("q_lora_rank", 0),
            ("o_lora_rank", 0),
        ):
            _require_int(name, getattr(self, name), minimum, MAX_DIM)
        _require(
            self.num_routed_experts == 0 or self.num_experts_per_token <= self.num_routed_experts,
            "num_experts_per_tok",
            f"({self.num_experts_per_token}) must be <= n_routed_experts "
            f"({self.num_routed_experts})",
        )
        _require(
            self.num_routed_experts == 0 or self.moe_intermediate_size >= 1,
            "moe_intermediate_size",
            f"must be >= 1 with {self.num_routed_experts} routed experts",
        )


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN rotary scaling (DeepSeek-V4 applies it to the compressed layers' rope only)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        _require_real("rope_scaling.factor", self.factor, 1.0)
        _require_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
            1,
            MAX_POSITIONS,
        )
        _require_real("rope_scaling.beta_fast", self.beta_fast, 0.0)
        _require_real("rope_scaling.beta_slow", self.beta_slow, 0.0)
        _require(
            self.beta_fast > self.beta_slow,
            "rope_scaling.beta_fast",
            f"({self.beta_fast}) must be > beta_slow ({self.beta_slow})",
        )


@dataclass(frozen=True, slots=True)
class Quantization:
    """How a block-FP8 DeepSeek-V4 checkpoint stores its weights (config.json's
    `quantization_config` with quant_method fp8, fmt e4m3, activation_scheme dynamic, plus
    `expert_dtype`): dense linears FP8 E4M3 with one scale per 128x128 block; routed experts FP4
    (E2M1, two per byte, one E8M0 scale per 32 values) or block FP8 like the dense linears."""

    scale_fmt: ScaleFmt = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: ExpertDtype = "fp4"

    def __post_init__(self) -> None:
        _require(
            self.scale_fmt in ("ue8m0", "float"),
            "quantization_config.scale_fmt",
            f"must be ue8m0 or float, got {self.scale_fmt!r}",
        )
        _require(
            tuple(self.weight_block_size) == (128, 128),
            "quantization_config.weight_block_size",
            f"must be [128, 128] for FP8, got {list(self.weight_block_size)}",
        )
        _require(
            self.expert_dtype in ("fp4", "fp8"),
            "expert_dtype",
            f"must be fp4 or fp8, got {self.expert_dtype!r}",
        )


@dataclass(frozen=True, slots=True)
class DSV4Arch:
    """The DeepSeek-V4 architecture beyond its KV shape: hyper-connections, the grouped output
    projection, routing and rotary settings. Defaults are the published Flash config's."""

    hc_mult: int = 4  # residual streams (manifold-constrained hyper-connections)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    o_groups: int = 8  # head groups of the grouped output projection (o_lora_rank per group)
    num_hash_layers: int = 3  # the first layers route by a token-id -> experts table
    scoring_func: ScoringFunc = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0  # clamp of the experts' gate/up pre-activations (0: none)
    rope_theta: float = 10_000.0  # window-only layers
    compress_rope_theta: float = 160_000.0  # compressed layers (window and compressed rows)
    rope_scaling: YarnScaling | None = None  # applies to the compress rope
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _require_int("hc_mult", self.hc_mult, 1, 64)
        _require_int("hc_sinkhorn_iters", self.hc_sinkhorn_iters, 1, 1000)
        _require_real("hc_eps", self.hc_eps, 0.0)
        _require_int("o_groups", self.o_groups, 1, MAX_DIM)
        _require_int("num_hash_layers", self.num_hash_layers, 0, MAX_LAYERS)
        _require(
            self.scoring_func in ("sqrtsoftplus", "softmax", "sigmoid"),
            "scoring_func",
            f"must be sqrtsoftplus, softmax or sigmoid, got {self.scoring_func!r}",
        )
        _require_real("routed_scaling_factor", self.routed_scaling_factor, 0.0)
        _require(
            isinstance(self.norm_topk_prob, bool),
            "norm_topk_prob",
            f"must be true or false, got {self.norm_topk_prob!r}",
        )
        _require_real("swiglu_limit", self.swiglu_limit, 0.0)
        _require_real("rope_theta", self.rope_theta, 1.0)
        _require_real("compress_rope_theta", self.compress_rope_theta, 1.0)
        _require_real("rms_norm_eps", self.rms_norm_eps, 0.0)
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")


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
    arch: DSV4Arch = field(default_factory=DSV4Arch)
    # Checkpoint storage: block-FP8 (None: unquantized) and the dtype of what is not quantized.
    quantization: Quantization | None = None
    weight_dtype: WeightDtype = "bf16"
    family: Literal["dsv4"] = field(default="dsv4", init=False)

    def __post_init__(self) -> None:
        _require_int("num_hidden_layers", self.num_hidden_layers, 1, MAX_LAYERS)
        _require_int("num_nextn_predict_layers", self.num_nextn_predict_layers, 0, 16)
        for name, minimum in (
            ("qk_nope_head_dim", 1),
            ("qk_rope_head_dim", 0),
            ("index_head_dim", 1),
            ("index_n_heads", 1),
            ("index_topk", 1),
        ):
            _require_int(name, getattr(self, name), minimum, MAX_DIM)
        _require_int("window_size", self.window_tokens, 1, MAX_DIM)
        _require_int("max_position_embeddings", self.max_position_embeddings, 1, MAX_POSITIONS)
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
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        _require_int("kv_page_align_bytes", self.kv_page_align_bytes, 1, MAX_DIM)
        for name, value, allowed in (
            ("kv_cache_dtype", self.kv_dtype, ("fp8_e4m3", "bf16", "fp32")),
            ("indexer_dtype", self.indexer_dtype, ("fp8", "fp4", "bf16", "fp32")),
            ("state_dtype", self.state_dtype, ("fp32", "bf16")),
        ):
            _require(value in allowed, name, f"must be one of {list(allowed)}, got {value!r}")
        _require(
            self.weight_dtype in ("bf16", "fp16", "fp32"),
            "torch_dtype",
            f"must be bfloat16, float16 or float32, got {self.weight_dtype!r}",
        )
        _require(
            self.weights.num_dense_layers <= self.num_hidden_layers,
            "first_k_dense_replace",
            f"is {self.weights.num_dense_layers}, more than the "
            f"{self.num_hidden_layers} layers (num_hidden_layers)",
        )
        heads = self.weights.num_attention_heads
        _require(
            heads % self.arch.o_groups == 0,
            "o_groups",
            f"({self.arch.o_groups}) must divide num_attention_heads ({heads})",
        )
        _require(
            self.arch.num_hash_layers <= self.num_hidden_layers,
            "num_hash_layers",
            f"is {self.arch.num_hash_layers}, more than the {self.num_hidden_layers} layers",
        )
        _require(
            self.arch.num_hash_layers == 0 or self.weights.num_routed_experts > 0,
            "num_hash_layers",
            "needs routed experts (n_routed_experts > 0)",
        )

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
    layer_types: tuple[LayerType, ...]
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
        _require(
            len(self.layer_types) <= MAX_LAYERS,
            "num_hidden_layers",
            f"must be <= {MAX_LAYERS}, got {len(self.layer_types)}",
        )
        bad = sorted({t for t in self.layer_types if t not in ("full", "sliding")})
        _require(not bad, "layer_types", f"values {bad} not in ['full', 'sliding']")
        _require_int("sliding_window", self.window_tokens, 1, MAX_DIM)
        _require_int("num_key_value_heads", self.num_key_value_heads, 1, MAX_DIM)
        _require_int("head_dim", self.head_dim, 1, MAX_DIM)
        _require_int("v_head_dim", self.v_head_dim, 1, MAX_DIM)
        _require_int("max_position_embeddings", self.max_position_embeddings, 1, MAX_POSITIONS)
        _require_int("num_nextn_predict_layers", self.num_nextn_predict_layers, 0, 16)
        heads = self.weights.num_attention_heads
        _require(
            heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"({self.num_key_value_heads}) must divide num_attention_heads ({heads})",
        )

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)


ModelConfig = DSV4Config | HybridSWAConfig


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ModelConfigError(f"model config field '{field_name}' {message}")


def _require_real(field_name: str, value: float, minimum: float) -> None:
    _require(
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
        field_name,
        f"must be a finite number, got {value!r}",
    )
    _require(value >= minimum, field_name, f"must be >= {minimum}, got {value}")


def _require_int(field_name: str, value: int, minimum: int, maximum: int) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool),
        field_name,
        f"must be an integer, got {value!r}",
    )
    _require(value >= minimum, field_name, f"must be >= {minimum}, got {value}")
    _require(value <= maximum, field_name, f"must be <= {maximum}, got {value}")
