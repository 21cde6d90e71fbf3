"""Per-layer math of the generic hybrid-SWA reference model (Llama-style names), shared by the
naive oracle and the paged engine so both compute the same values. DeepSeek-V4's blocks are in
dsv4.py, attention.py, compressor.py, indexer.py, moe.py, hyper.py and rope.py.

Pure tensor functions over a weight dict; no pools, no request state.
"""

from __future__ import annotations

import math

import torch

from dsv4_common.core.model import HybridSWAConfig
from dsv4_worker.model.ops import ROPE_THETA, rms_norm, rope, stored, swiglu
from dsv4_worker.model.params import Params


def ffn(h: torch.Tensor, p: Params, layer: int) -> torch.Tensor:
    """Post-attention half of a block: h + FFN(norm(h))."""
    pre = f"model.layers.{layer}"
    x = rms_norm(h, p.vector(f"{pre}.post_attention_layernorm.weight"))
    m = f"{pre}.mlp"
    return h + swiglu(x, p, f"{m}.gate_proj.weight", f"{m}.up_proj.weight", f"{m}.down_proj.weight")


def embed(p: Params, token_ids: torch.Tensor) -> torch.Tensor:
    return p.rows("model.embed_tokens.weight", token_ids)


def logits(p: Params, h: torch.Tensor) -> torch.Tensor:
    return p.linear(rms_norm(h, p.vector("model.norm.weight")), "lm_head.weight")


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [T, Hq, D], keys [T or 1, K, Hk, D], values [T or 1, K, Hk, Dv], mask [T, K] (True =
    attend); Hq is a multiple of Hk (grouped heads). Returns [T, Hq * Dv]."""
    t, hq, d = q.shape
    hk = keys.shape[2]
    group = hq // hk
    qg = q.view(t, hk, group, d)
    scores = torch.einsum("tkgd,tnkd->tkgn", qg, keys.expand(t, -1, -1, -1)) / math.sqrt(d)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgn,tnkv->tkgv", probs, values.expand(t, -1, -1, -1))
    return out.reshape(t, hq * values.shape[-1])


# ---------------------------------------------------------------------------------------------
# Generic hybrid SWA


def hybrid_query_kv(
    m: HybridSWAConfig, p: Params, layer: int, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim] and the KV rows [T, kv_heads * (head_dim + v_head_dim)] as
    stored (the layout's row: rotated keys, then values)."""
    a = f"model.layers.{layer}.self_attn"
    t, kvh = len(x), m.num_key_value_heads
    q = p.linear(x, f"{a}.q_proj.weight").view(t, -1, m.head_dim)
    q = rope(q, positions, m.head_dim, ROPE_THETA)
    k = rope(
        p.linear(x, f"{a}.k_proj.weight").view(t, kvh, m.head_dim),
        positions,
        m.head_dim,
        ROPE_THETA,
    )
    v = p.linear(x, f"{a}.v_proj.weight").view(t, kvh, m.v_head_dim)
    row = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    return q, stored(row, m.kv_dtype)


def hybrid_split_kv(m: HybridSWAConfig, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV rows [N, row] -> keys [N, kv_heads, head_dim], values [N, kv_heads, v_head_dim]."""
    kvh = m.num_key_value_heads
    split = kvh * m.head_dim
    return rows[:, :split].view(-1, kvh, m.head_dim), rows[:, split:].view(-1, kvh, m.v_head_dim)


def hybrid_output(p: Params, layer: int, attn: torch.Tensor) -> torch.Tensor:
    return p.linear(attn, f"model.layers.{layer}.self_attn.o_proj.weight")
