"""Per-layer math of the reference models, shared by the naive oracle and the paged engine so
both compute the same values: projections, the lightning indexer, masked attention and the FFN.

Pure tensor functions over a weight dict; no pools, no request state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from dsv4_common.core.model import DSV4Config, HybridSWAConfig
from dsv4_worker.model.ops import ROPE_THETA, rms_norm, rope, stored, swiglu

Params = Mapping[str, torch.Tensor]


def ffn(h: torch.Tensor, p: Params, layer: int, experts_per_token: int) -> torch.Tensor:
    """Post-attention half of a block: h + FFN(norm(h)), dense or MoE (as the weights say)."""
    pre = f"model.layers.{layer}"
    x = rms_norm(h, p[f"{pre}.post_attention_layernorm.weight"])
    if f"{pre}.mlp.gate.weight" in p:
        return h + moe(x, p, f"{pre}.mlp", experts_per_token)
    return h + _expert(x, p, f"{pre}.mlp")


def _expert(x: torch.Tensor, p: Params, prefix: str) -> torch.Tensor:
    return swiglu(
        x,
        p[f"{prefix}.gate_proj.weight"],
        p[f"{prefix}.up_proj.weight"],
        p[f"{prefix}.down_proj.weight"],
    )


def moe(x: torch.Tensor, p: Params, prefix: str, experts_per_token: int) -> torch.Tensor:
    """Routed experts (softmax router, top-k renormalised, ties to the lower expert) plus the
    shared experts. Every expert runs on every token and unrouted ones get weight 0: wasteful,
    but per-token results do not depend on the batch (the reference's point)."""
    router = torch.softmax(F.linear(x, p[f"{prefix}.gate.weight"]), dim=-1)
    num_experts = router.shape[-1]
    top = torch.sort(router, dim=-1, descending=True, stable=True).indices[:, :experts_per_token]
    weights = torch.zeros_like(router).scatter_(-1, top, router.gather(-1, top))
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        out = out + weights[:, e : e + 1] * _expert(x, p, f"{prefix}.experts.{e}")
    if f"{prefix}.shared_experts.gate_proj.weight" in p:
        out = out + _expert(x, p, f"{prefix}.shared_experts")
    return out


def embed(p: Params, token_ids: torch.Tensor) -> torch.Tensor:
    return p["model.embed_tokens.weight"][token_ids]


def logits(p: Params, h: torch.Tensor) -> torch.Tensor:
    return F.linear(rms_norm(h, p["model.norm.weight"]), p["lm_head.weight"])


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
# DeepSeek-V4


def dsv4_query_kv(
    m: DSV4Config, p: Params, layer: int, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim] (rotated) and the window KV rows [T, head_dim] as stored."""
    a = f"model.layers.{layer}.self_attn"
    heads = m.weights.num_attention_heads
    if f"{a}.q_a_proj.weight" in p:
        q_lat = rms_norm(F.linear(x, p[f"{a}.q_a_proj.weight"]), p[f"{a}.q_a_layernorm.weight"])
        q = F.linear(q_lat, p[f"{a}.q_b_proj.weight"])
    else:
        q = F.linear(x, p[f"{a}.q_proj.weight"])
    q = rope(q.view(len(x), heads, m.head_dim), positions, m.qk_rope_head_dim, ROPE_THETA)
    kv = rms_norm(F.linear(x, p[f"{a}.kv_proj.weight"]), p[f"{a}.kv_norm.weight"])
    kv = rope(kv, positions, m.qk_rope_head_dim, ROPE_THETA)
    return q, stored(kv, kv_storage(m))


def dsv4_output(p: Params, layer: int, attn: torch.Tensor) -> torch.Tensor:
    a = f"model.layers.{layer}.self_attn"
    if f"{a}.o_a_proj.weight" in p:
        return F.linear(F.linear(attn, p[f"{a}.o_a_proj.weight"]), p[f"{a}.o_b_proj.weight"])
    return F.linear(attn, p[f"{a}.o_proj.weight"])


def indexer_query(
    m: DSV4Config, p: Params, layer: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning-indexer queries [T, n_heads, dim] and head weights [T, n_heads]."""
    idx = f"model.layers.{layer}.self_attn.indexer"
    q = F.linear(x, p[f"{idx}.q_proj.weight"]).view(len(x), m.index_n_heads, m.index_head_dim)
    return q, F.linear(x, p[f"{idx}.weights_proj.weight"])


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores [T, C] of compressed rows with indexer keys [C, dim]: sum_h w_h relu(q_h . k)."""
    dots = torch.einsum("thd,cd->thc", q, keys) / math.sqrt(q.shape[-1])
    return torch.einsum("th,thc->tc", w, torch.relu(dots))


def top_k_mask(scores: torch.Tensor, available: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the (at most) k available entries with the highest scores [T, C] -> bool.

    NOTE: ties (relu scores are often exactly 0) go to the lower row index, whatever the
    number of columns, so every caller selects the same rows (a stable sort, not topk)."""
    if scores.shape[-1] == 0:
        return available
    masked = scores.masked_fill(~available, float("-inf"))
    kk = min(k, scores.shape[-1])
    top = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :kk]
    chosen = torch.zeros_like(available).scatter_(-1, top, True)
    return chosen & available


def kv_storage(m: DSV4Config | HybridSWAConfig) -> str:
    return m.kv_dtype


def indexer_storage(m: DSV4Config) -> str:
    return m.indexer_dtype


# ---------------------------------------------------------------------------------------------
# Generic hybrid SWA


def hybrid_query_kv(
    m: HybridSWAConfig, p: Params, layer: int, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim] and the KV rows [T, kv_heads * (head_dim + v_head_dim)] as
    stored (the layout's row: rotated keys, then values)."""
    a = f"model.layers.{layer}.self_attn"
    t, kvh = len(x), m.num_key_value_heads
    q = F.linear(x, p[f"{a}.q_proj.weight"]).view(t, -1, m.head_dim)
    q = rope(q, positions, m.head_dim, ROPE_THETA)
    k = rope(
        F.linear(x, p[f"{a}.k_proj.weight"]).view(t, kvh, m.head_dim),
        positions,
        m.head_dim,
        ROPE_THETA,
    )
    v = F.linear(x, p[f"{a}.v_proj.weight"]).view(t, kvh, m.v_head_dim)
    row = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    return q, stored(row, kv_storage(m))


def hybrid_split_kv(m: HybridSWAConfig, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV rows [N, row] -> keys [N, kv_heads, head_dim], values [N, kv_heads, v_head_dim]."""
    kvh = m.num_key_value_heads
    split = kvh * m.head_dim
    return rows[:, :split].view(-1, kvh, m.head_dim), rows[:, split:].view(-1, kvh, m.v_head_dim)


def hybrid_output(p: Params, layer: int, attn: torch.Tensor) -> torch.Tensor:
    return F.linear(attn, p[f"model.layers.{layer}.self_attn.o_proj.weight"])
