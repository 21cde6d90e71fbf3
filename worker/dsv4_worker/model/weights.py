"""Parameters of the reference models: names and shapes from the model config, seeded random
initialization, and safetensors save/load. Never downloads anything.

DeepSeek-V4 parameters carry the published checkpoint's names (DeepSeek's release, no `model.`
prefix; transformers' names are mapped to these by `checkpoint_names.py`), with the names and
shapes `dsv4_common.core.tensors` lists (its docstring has the table; the planner counts weight
bytes from the same lists).

The generic hybrid family keeps HuggingFace Llama-style names (`model.layers.N.self_attn...`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from dsv4_common.core import tensors as T
from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfig
from dsv4_worker.model.stored import Stored

Shapes = dict[str, tuple[int, ...]]
ORACLE_DTYPE = torch.float64  # what `init_weights` holds by default: the oracle tests' dtype
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


def dsv4_shapes(params: Iterable[T.Param]) -> Shapes:
    """Names and shapes of DeepSeek-V4 parameters as `dsv4_common.core.tensors` lists them
    (the planner counts bytes from the same lists)."""
    return {name: p.shape for p in params for name in p.names()}


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
    if isinstance(model, DSV4Config):
        if model.weights.num_dense_layers:
            raise NotImplementedError(
                f"model {model.name}: the worker's DeepSeek-V4 has no dense FFN layers "
                "(first_k_dense_replace); the release has none"
            )
        shapes = dsv4_shapes((*T.embedding_params(model), *T.head_params(model)))
        for i in range(model.num_hidden_layers):
            shapes |= dsv4_shapes(T.layer_params(model, i))
        return shapes
    w = model.weights
    embed, norm, head = global_names(model)
    shapes = {
        embed: (w.vocab_size, w.hidden_size),
        norm: (w.hidden_size,),
        head: (w.vocab_size, w.hidden_size),
    }
    for i in range(model.num_hidden_layers):
        shapes |= _hybrid_layer_shapes(model, i)
    return shapes


def mtp_param_shapes(model: DSV4Config) -> Shapes:
    """Every MTP (NextN) layer's parameters: `mtp.K.` + a block of compress ratio 0 (the
    ratio list's tail) + its embedding/hidden projections, norms and head hyper-connection
    (`dsv4_common.core.tensors.mtp_params`)."""
    shapes: Shapes = {}
    for k in range(model.num_nextn_predict_layers):
        shapes |= dsv4_shapes(T.mtp_params(model, k))
    return shapes


def all_param_shapes(model: ModelConfig) -> Shapes:
    """Target layers' and (DeepSeek-V4) MTP layers' parameters."""
    if isinstance(model, DSV4Config):
        return param_shapes(model) | mtp_param_shapes(model)
    return param_shapes(model)


def stage_param_names(
    model: ModelConfig, layers: range, *, first: bool, last: bool, draft: bool = False
) -> set[str]:
    """The parameters one PP stage holds: its layers, the embedding on the first stage, the
    final norm, LM head (and DSV4's head hyper-connection) on the last, and there, when the
    plan speculates (`draft`), the MTP layers and the embedding they read. The planner counts
    the same (`dsv4_common.plan.weights.rank_extra_bytes`): MTP is loaded exactly when it is
    counted."""
    prefixes = tuple(f"{layer_prefix(model, i)}." for i in layers)
    embed, norm, head = global_names(model)
    names = {n for n in param_shapes(model) if n.startswith(prefixes)}
    if first:
        names.add(embed)
    if last:
        names |= {norm, head}
        if isinstance(model, DSV4Config):
            names |= {"hc_head_fn", "hc_head_base", "hc_head_scale"}
            if draft and model.num_nextn_predict_layers:
                names |= {embed, *mtp_param_shapes(model)}
    return names


def stage_weights(weights: Mapping[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The stage's subset of a whole model's weights."""
    return {n: t for n, t in weights.items() if n in names}


def init_weights(
    model: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = ORACLE_DTYPE,
) -> dict[str, torch.Tensor]:
    """Seeded random weights of the target layers: float32 values held as `dtype` (default
    float64, the oracle tests'), identical on every device (drawn on the CPU). Every parameter
    is random, norm gains, biases, sinks and hyper-connection scales included; a hash table
    draws distinct experts per token (int64). Serving draws them in their stored formats
    (`random_stored.py`)."""
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
        out[name] = value.to(device=device, dtype=dtype)
    return out


class WeightsError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor."""


def check_weights(
    model: ModelConfig,
    weights: Mapping[str, torch.Tensor] | Mapping[str, Stored],
    names: set[str] | None = None,
) -> None:
    """`weights` hold exactly the model's target parameters (or the subset `names`, MTP
    layers allowed), each of its shape."""
    shapes = param_shapes(model) if names is None else all_param_shapes(model)
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
    """Floats as float32, integers as they are, in one safetensors file."""
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
    """The file's tensors (only `names` when given: a PP stage reads its own slice) as
    stored."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        keys = list(f.keys())
        if names is not None:
            keys = [k for k in keys if k in names]
        for k in keys:
            t = f.get_tensor(k)
            weights[k] = t
    check_weights(model, weights, names)
    return weights
