"""Parameters of the reference models: names and shapes from the model config, seeded random
initialization, and safetensors save/load. Never downloads anything.

DeepSeek-V4 parameters carry the published checkpoint's names (DeepSeek's release, no `model.`
prefix; transformers' names are mapped to these by `checkpoint.py`). Per layer N, `hc` residual
streams, `k` = 2 for an overlapped (CSA) compressor and 1 otherwise:

    layers.N.attn_norm, ffn_norm                         [H]
    layers.N.hc_attn_{fn, base, scale}, hc_ffn_*         [(2+hc)*hc, hc*H], [(2+hc)*hc], [3]
    layers.N.attn.wq_a, q_norm, wq_b                     q latent (q_lora_rank), heads*head_dim
    layers.N.attn.wkv, kv_norm                           one latent KV head (K == V)
    layers.N.attn.wo_a, wo_b                             grouped output projection
    layers.N.attn.attn_sink                              [heads]
    layers.N.attn.compressor.{wkv, wgate, ape, norm}     [k*d, H] x2, [ratio, k*d], [d]
    layers.N.attn.indexer.{wq_b, weights_proj}           CSA layers
    layers.N.attn.indexer.compressor.{wkv, wgate, ape, norm}
    layers.N.ffn.gate.weight + gate.bias | gate.tid2eid  top-k layers | hash layers
    layers.N.ffn.experts.E.{w1, w2, w3}, ffn.shared_experts.{w1, w2, w3}
    embed.weight, head.weight, norm.weight, hc_head_{fn, base, scale}

The generic hybrid family keeps HuggingFace Llama-style names (`model.layers.N.self_attn...`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig
from dsv4_worker.model.ops import COMPUTE

Shapes = dict[str, tuple[int, ...]]
# Parameters initialized to 1 (norm gains) and those that stay exact integers.
NORM_SUFFIXES = ("norm.weight", "layernorm.weight")
INTEGER_SUFFIXES = ("gate.tid2eid",)


def global_names(model: ModelConfig) -> tuple[str, str, str]:
    """(embedding, final norm, LM head) parameter names of the model's family."""
    if isinstance(model, DSV4Config):
        return "embed.weight", "norm.weight", "head.weight"
    return "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def layer_prefix(model: ModelConfig, layer: int) -> str:
    return f"layers.{layer}" if isinstance(model, DSV4Config) else f"model.layers.{layer}"


def _compressor_shapes(prefix: str, hidden: int, dim: int, ratio: int, overlap: bool) -> Shapes:
    width = (2 if overlap else 1) * dim
    return {
        f"{prefix}.wkv.weight": (width, hidden),
        f"{prefix}.wgate.weight": (width, hidden),
        f"{prefix}.ape": (ratio, width),
        f"{prefix}.norm.weight": (dim,),
    }


def _hc_shapes(prefix: str, hc: int, hidden: int) -> Shapes:
    mixes = (2 + hc) * hc
    return {
        f"{prefix}_fn": (mixes, hc * hidden),
        f"{prefix}_base": (mixes,),
        f"{prefix}_scale": (3,),
    }


def _expert_shapes(prefix: str, hidden: int, inter: int) -> Shapes:
    return {
        f"{prefix}.w1.weight": (inter, hidden),
        f"{prefix}.w2.weight": (hidden, inter),
        f"{prefix}.w3.weight": (inter, hidden),
    }


def _dsv4_layer_shapes(m: DSV4Config, i: int) -> Shapes:
    w, arch = m.weights, m.arch
    h, d, heads = w.hidden_size, m.head_dim, w.num_attention_heads
    p = f"layers.{i}"
    a = f"{p}.attn"
    shapes: Shapes = {
        f"{p}.attn_norm.weight": (h,),
        f"{p}.ffn_norm.weight": (h,),
        **_hc_shapes(f"{p}.hc_attn", arch.hc_mult, h),
        **_hc_shapes(f"{p}.hc_ffn", arch.hc_mult, h),
        f"{a}.wq_a.weight": (w.q_lora_rank, h),
        f"{a}.q_norm.weight": (w.q_lora_rank,),
        f"{a}.wq_b.weight": (heads * d, w.q_lora_rank),
        f"{a}.wkv.weight": (d, h),
        f"{a}.kv_norm.weight": (d,),
        f"{a}.wo_a.weight": (arch.o_groups * w.o_lora_rank, heads * d // arch.o_groups),
        f"{a}.wo_b.weight": (h, arch.o_groups * w.o_lora_rank),
        f"{a}.attn_sink": (heads,),
    }
    ratio = m.compress_ratios[i] if i < len(m.compress_ratios) else 0
    if ratio:
        sparse = ratio == m.sparse_ratio
        shapes |= _compressor_shapes(f"{a}.compressor", h, d, ratio, overlap=sparse)
        if sparse:
            idx = f"{a}.indexer"
            shapes |= {
                f"{idx}.wq_b.weight": (m.index_n_heads * m.index_head_dim, w.q_lora_rank),
                f"{idx}.weights_proj.weight": (m.index_n_heads, h),
            }
            shapes |= _compressor_shapes(
                f"{idx}.compressor", h, m.index_head_dim, ratio, overlap=True
            )
    f = f"{p}.ffn"
    shapes[f"{f}.gate.weight"] = (w.num_routed_experts, h)
    if i < arch.num_hash_layers:
        shapes[f"{f}.gate.tid2eid"] = (w.vocab_size, w.num_experts_per_token)
    else:
        shapes[f"{f}.gate.bias"] = (w.num_routed_experts,)
    for e in range(w.num_routed_experts):
        shapes |= _expert_shapes(f"{f}.experts.{e}", h, w.moe_intermediate_size)
    if w.num_shared_experts:
        inter = w.num_shared_experts * w.moe_intermediate_size
        shapes |= _expert_shapes(f"{f}.shared_experts", h, inter)
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


def param_shapes(model: ModelConfig) -> Shapes:
    """Every parameter of the model's target layers (the MTP layer is loaded apart)."""
    w = model.weights
    embed, norm, head = global_names(model)
    shapes: Shapes = {
        embed: (w.vocab_size, w.hidden_size),
        norm: (w.hidden_size,),
        head: (w.vocab_size, w.hidden_size),
    }
    if isinstance(model, DSV4Config):
        hc = model.arch.hc_mult
        shapes |= {
            "hc_head_fn": (hc, hc * w.hidden_size),
            "hc_head_base": (hc,),
            "hc_head_scale": (1,),
        }
    for i in range(model.num_hidden_layers):
        if isinstance(model, DSV4Config):
            shapes |= _dsv4_layer_shapes(model, i)
        else:
            shapes |= _hybrid_layer_shapes(model, i)
    return shapes


def stage_param_names(model: ModelConfig, layers: range, *, first: bool, last: bool) -> set[str]:
    """The parameters one PP stage holds: its layers, the embedding on the first stage, the
    final norm, LM head (and DSV4's head hyper-connection) on the last."""
    prefixes = tuple(f"{layer_prefix(model, i)}." for i in layers)
    embed, norm, head = global_names(model)
    names = {n for n in param_shapes(model) if n.startswith(prefixes)}
    if first:
        names.add(embed)
    if last:
        names |= {norm, head}
        if isinstance(model, DSV4Config):
            names |= {"hc_head_fn", "hc_head_base", "hc_head_scale"}
    return names


def stage_weights(weights: Mapping[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The stage's subset of a whole model's weights."""
    return {n: t for n, t in weights.items() if n in names}


def init_weights(
    model: ModelConfig, seed: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights, float32 values held as float64 (the compute dtype), identical on
    every device (drawn on the CPU). Every parameter is random, norm gains, biases, sinks and
    hyper-connection scales included; a hash table draws distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    embed, _, head = global_names(model)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(param_shapes(model).items()):
        if name.endswith(INTEGER_SUFFIXES):
            experts = model.weights.num_routed_experts
            rows = [torch.randperm(experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
            out[name] = torch.stack(rows).to(device=device)
            continue
        if name.endswith(NORM_SUFFIXES):
            value = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith(("ape", "_base", "attn_sink", "gate.bias")):
            value = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("_scale"):
            value = 0.5 + torch.rand(shape, generator=gen)
        elif name == embed:
            value = torch.randn(shape, generator=gen)
        else:
            # The LM head gets a wide spread so greedy choices are never near-ties.
            gain = 4.0 if name == head else 1.0
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

    tensors = {
        k: (v if not v.is_floating_point() else v.detach().to(torch.float32)).contiguous().cpu()
        for k, v in weights.items()
    }
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
            t = f.get_tensor(k)
            weights[k] = t.to(COMPUTE) if t.is_floating_point() else t.long()
    check_weights(model, weights, names)
    return weights
