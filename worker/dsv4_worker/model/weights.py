"""Parameters of the reference models: names and shapes from the model config, seeded random
initialization, and safetensors save/load. Never downloads anything.

Names follow the HuggingFace DeepSeek layout where one exists (`model.embed_tokens`,
`model.layers.{i}.self_attn.q_a_proj`, `mlp.gate_proj`, `lm_head`, ...). The DSV4-specific
parts are ours, documented here because no public checkpoint index was at hand:

    model.layers.{i}.self_attn.kv_proj / kv_norm            single latent KV head (K == V)
    model.layers.{i}.self_attn.o_a_proj / o_b_proj          low-rank output (o_lora_rank)
    model.layers.{i}.self_attn.compressor.{kv_proj, score_proj, position_bias, norm}
    model.layers.{i}.self_attn.indexer.{q_proj, weights_proj}  (ratio == sparse_ratio layers)
    model.layers.{i}.self_attn.indexer.compressor.{kv_proj, score_proj, position_bias, norm}

An overlapped compressor (ratio == sparse_ratio) projects two halves per token (the previous
and the current block's view), so its projections are 2x wide and its bias is [2, ratio, dim].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig
from dsv4_worker.model.ops import COMPUTE

Shapes = dict[str, tuple[int, ...]]
NORM_SUFFIXES = ("norm.weight", "layernorm.weight")


def _compressor_shapes(prefix: str, hidden: int, dim: int, ratio: int, overlap: bool) -> Shapes:
    halves = 2 if overlap else 1
    bias: tuple[int, ...] = (2, ratio, dim) if overlap else (ratio, dim)
    return {
        f"{prefix}.kv_proj.weight": (halves * dim, hidden),
        f"{prefix}.score_proj.weight": (halves * dim, hidden),
        f"{prefix}.position_bias": bias,
        f"{prefix}.norm.weight": (dim,),
    }


def _dsv4_layer_shapes(m: DSV4Config, i: int) -> Shapes:
    w = m.weights
    h, d, heads = w.hidden_size, m.head_dim, w.num_attention_heads
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    shapes: Shapes = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{a}.kv_proj.weight": (d, h),
        f"{a}.kv_norm.weight": (d,),
    }
    if w.q_lora_rank:
        shapes |= {
            f"{a}.q_a_proj.weight": (w.q_lora_rank, h),
            f"{a}.q_a_layernorm.weight": (w.q_lora_rank,),
            f"{a}.q_b_proj.weight": (heads * d, w.q_lora_rank),
        }
    else:
        shapes[f"{a}.q_proj.weight"] = (heads * d, h)
    if w.o_lora_rank:
        shapes |= {
            f"{a}.o_a_proj.weight": (w.o_lora_rank, heads * d),
            f"{a}.o_b_proj.weight": (h, w.o_lora_rank),
        }
    else:
        shapes[f"{a}.o_proj.weight"] = (h, heads * d)
    ratio = m.compress_ratios[i] if i < len(m.compress_ratios) else 0
    if ratio:
        sparse = ratio == m.sparse_ratio
        shapes |= _compressor_shapes(f"{a}.compressor", h, d, ratio, overlap=sparse)
        if sparse:
            idx = f"{a}.indexer"
            shapes |= {
                f"{idx}.q_proj.weight": (m.index_n_heads * m.index_head_dim, h),
                f"{idx}.weights_proj.weight": (m.index_n_heads, h),
            }
            shapes |= _compressor_shapes(
                f"{idx}.compressor", h, m.index_head_dim, ratio, overlap=True
            )
    if w.num_routed_experts and i >= w.num_dense_layers:
        shapes |= _moe_shapes(
            p, h, w.num_routed_experts, w.num_shared_experts, w.moe_intermediate_size
        )
    else:
        shapes |= _ffn_shapes(f"{p}.mlp", h, w.intermediate_size)
    return shapes


def _hybrid_layer_shapes(m: HybridSWAConfig, i: int) -> Shapes:
    w = m.weights
    h, heads, kvh = w.hidden_size, w.num_attention_heads, m.num_key_value_heads
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    return {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{a}.q_proj.weight": (heads * m.head_dim, h),
        f"{a}.k_proj.weight": (kvh * m.head_dim, h),
        f"{a}.v_proj.weight": (kvh * m.v_head_dim, h),
        f"{a}.o_proj.weight": (h, heads * m.v_head_dim),
        **_ffn_shapes(f"{p}.mlp", h, w.intermediate_size),
    }


def _ffn_shapes(prefix: str, hidden: int, inter: int) -> Shapes:
    if inter < 1:
        raise NotImplementedError(
            "a dense FFN layer needs intermediate_size >= 1 (or MoE layers: n_routed_experts)"
        )
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def _moe_shapes(prefix: str, hidden: int, routed: int, shared: int, inter: int) -> Shapes:
    """A router, `routed` experts and `shared` experts merged into one wider FFN."""
    shapes: Shapes = {f"{prefix}.mlp.gate.weight": (routed, hidden)}
    for e in range(routed):
        shapes |= _ffn_shapes(f"{prefix}.mlp.experts.{e}", hidden, inter)
    if shared:
        shapes |= _ffn_shapes(f"{prefix}.mlp.shared_experts", hidden, shared * inter)
    return shapes


def param_shapes(model: ModelConfig) -> Shapes:
    """Every parameter of the model's target layers (no MTP draft layer yet)."""
    w = model.weights
    shapes: Shapes = {
        "model.embed_tokens.weight": (w.vocab_size, w.hidden_size),
        "model.norm.weight": (w.hidden_size,),
        "lm_head.weight": (w.vocab_size, w.hidden_size),
    }
    for i in range(model.num_hidden_layers):
        if isinstance(model, DSV4Config):
            shapes |= _dsv4_layer_shapes(model, i)
        else:
            shapes |= _hybrid_layer_shapes(model, i)
    return shapes


def stage_param_names(model: ModelConfig, layers: range, *, first: bool, last: bool) -> set[str]:
    """The parameters one PP stage holds: its layers, the embedding on the first stage, the
    final norm and LM head on the last."""
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    names = {n for n in param_shapes(model) if n.startswith(prefixes)}
    if first:
        names.add("model.embed_tokens.weight")
    if last:
        names |= {"model.norm.weight", "lm_head.weight"}
    return names


def stage_weights(weights: Mapping[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The stage's subset of a whole model's weights."""
    return {n: t for n, t in weights.items() if n in names}


def init_weights(
    model: ModelConfig, seed: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights, float32 values held as float64 (the compute dtype), identical on
    every device (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(param_shapes(model).items()):
        if name.endswith(NORM_SUFFIXES):
            value = torch.ones(shape)
        elif name.endswith("position_bias"):
            value = torch.randn(shape, generator=gen) * 0.5
        elif name == "model.embed_tokens.weight":
            value = torch.randn(shape, generator=gen)
        else:
            # lm_head gets a wide spread so greedy choices are never near-ties.
            gain = 4.0 if name == "lm_head.weight" else 1.0
            value = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[-1]))
        out[name] = value.to(device=device, dtype=COMPUTE)
    return out


class WeightsError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor."""


def check_weights(
    model: ModelConfig, weights: Mapping[str, torch.Tensor], names: set[str] | None = None
) -> None:
    """`weights` hold exactly the model's parameters (or the subset `names`), each of its
    shape."""
    shapes = param_shapes(model)
    if names is not None:
        shapes = {n: s for n, s in shapes.items() if n in names}
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(set(weights) - set(shapes))
    if missing or unexpected:
        raise WeightsError(
            f"checkpoint does not match {model.name}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise WeightsError(f"{name}: shape {tuple(weights[name].shape)}, expected {shape}")


def save_weights(path: Path, weights: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in weights.items()}
    save_file(tensors, str(path))


def load_weights(
    path: Path,
    model: ModelConfig,
    device: torch.device | str = "cpu",
    names: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (only `names` when given: a PP stage reads its own slice)."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        keys = list(f.keys())
        if names is not None:
            keys = [k for k in keys if k in names]
        for k in keys:
            weights[k] = f.get_tensor(k).to(COMPUTE)
    check_weights(model, weights, names)
    return weights
