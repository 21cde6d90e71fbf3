"""DeepSeek-V4's mixture of experts: a router scores every routed expert (sqrtsoftplus,
softmax or sigmoid of the gate's logits); top-k layers pick the k best by score plus the
correction bias (`gate.bias`, which steers the choice but not the weights), hash layers take
the k experts a fixed token-id table (`gate.tid2eid`) lists. The chosen experts' scores,
normalized to sum 1 (norm_topk_prob) and times routed_scaling_factor, weight their SwiGLU
outputs (clamped at swiglu_limit); the shared experts add to every token.

NOTE: ties in the top-k go to the lower expert index (a stable sort), so the choice never
depends on the batch. The router scores in float32 at least (DeepSeek's reference does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model.compute import at_least_float32
from dsv4_worker.model.ops import swiglu
from dsv4_worker.model.params import Params


def scores(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits)


def route(
    m: DSV4Config, p: Params, layer: int, x: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, k] (long), weights [T, k] in float32 at least) of every token."""
    g = f"layers.{layer}.ffn.gate"
    hi = at_least_float32(x.dtype)
    s = scores(p.linear(x.to(hi), f"{g}.weight"), m.arch.scoring_func)
    k = m.weights.num_experts_per_token
    if layer < m.arch.num_hash_layers:
        chosen = p.table(f"{g}.tid2eid")[ids].long()
    else:
        biased = s + p.vector(f"{g}.bias", hi)
        chosen = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = s.gather(-1, chosen)
    if m.arch.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, weights * m.arch.routed_scaling_factor


def moe(m: DSV4Config, p: Params, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The FFN of layer `layer` on its normalized input `x` [T, H]; `ids` [T] are the tokens'
    ids (hash routing)."""
    f = f"layers.{layer}.ffn"
    limit = m.arch.swiglu_limit
    chosen, weights = route(m, p, layer, x, ids)
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        e_ = f"{f}.experts.{e}"
        y = swiglu(x[rows], p, f"{e_}.w1.weight", f"{e_}.w3.weight", f"{e_}.w2.weight", limit)
        out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
    if f"{f}.shared_experts.w1.weight" in p:
        s = f"{f}.shared_experts"
        out = out + swiglu(x, p, f"{s}.w1.weight", f"{s}.w3.weight", f"{s}.w2.weight", limit)
    return out
