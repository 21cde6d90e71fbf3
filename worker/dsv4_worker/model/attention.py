"""DeepSeek-V4 attention pieces shared by the naive oracle and the paged engine.

Queries: q latent = norm(wq_a x) (also the indexer's input), heads = wq_b(latent), each head
RMS-normalized without gain, then rotated. Keys and values are one latent head (K == V):
norm(wkv x), rotated, stored in the window pool. Every head adds a learned sink logit to its
softmax (a slot that absorbs weight and contributes nothing). Because V carries the keys'
rotation, the output's rope channels are rotated back by the query position. The grouped
output projection maps each of `o_groups` head groups to o_lora_rank with its own block of
wo_a, then wo_b mixes the groups to the hidden size.
"""

from __future__ import annotations

import torch

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model.ops import rms_norm
from dsv4_worker.model.params import Params
from dsv4_worker.model.rope import rotate


def query(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, heads, head_dim] rotated, q latent [T, q_lora_rank])."""
    a, eps = f"layers.{layer}.attn", m.arch.rms_norm_eps
    latent = rms_norm(p.linear(x, f"{a}.wq_a.weight"), p.vector(f"{a}.q_norm.weight"), eps)
    q = p.linear(latent, f"{a}.wq_b.weight").view(len(x), -1, m.head_dim)
    return rotate(rms_norm(q, None, eps), positions, freq), latent


def window_kv(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
) -> torch.Tensor:
    """The window KV rows [T, head_dim] before they are stored (the pool's write rounds
    them to `kv_cache_dtype`; the oracle rounds them the same way: kv_quant.stored_kv)."""
    a = f"layers.{layer}.attn"
    kv = rms_norm(
        p.linear(x, f"{a}.wkv.weight"), p.vector(f"{a}.kv_norm.weight"), m.arch.rms_norm_eps
    )
    return rotate(kv, positions, freq)


def attend(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [T, heads, D] over one K == V head `kv` [K, D] where `mask` [T, K] is True; each head
    also has a sink logit. Returns [T, heads, D]."""
    logits = torch.matmul(q, kv.t()) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks.view(1, -1, 1).expand(len(q), -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, kv)


def attend_rows(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """`attend` for tokens with keys of their own: q [N, heads, D] over `kv` [N, K, D] where
    `mask` [N, K] is True (decode tokens of different requests in one batch)."""
    logits = torch.bmm(q, kv.transpose(1, 2)) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks.view(1, -1, 1).expand(len(q), -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.bmm(probs, kv)


def output(
    m: DSV4Config,
    p: Params,
    layer: int,
    out: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
) -> torch.Tensor:
    """[T, heads, D] attention output -> [T, hidden]: un-rotate, grouped projection, mix."""
    a, groups = f"layers.{layer}.attn", m.arch.o_groups
    t = len(out)
    grouped = rotate(out, positions, freq, inverse=True).reshape(t, groups, -1)
    wo_a = p.dense(f"{a}.wo_a.weight", out.dtype)
    per_group = wo_a.view(groups, -1, wo_a.shape[-1])  # [groups, o_lora_rank, in]
    mid = torch.bmm(grouped.transpose(0, 1), per_group.transpose(1, 2)).transpose(0, 1)
    mid = mid.reshape(t, -1)
    return p.linear(mid, f"{a}.wo_b.weight")
