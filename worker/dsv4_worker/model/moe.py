"""DeepSeek-V4's mixture of experts: a router scores every routed expert (sqrtsoftplus,
softmax or sigmoid of the gate's logits); top-k layers pick the k best by score plus the
correction bias (`gate.bias`, which steers the choice but not the weights), hash layers take
the k experts a fixed token-id table (`gate.tid2eid`) lists. The chosen experts' scores,
normalized to sum 1 (norm_topk_prob) and times routed_scaling_factor, weight their SwiGLU
outputs (clamped at swiglu_limit); the shared experts add to every token.

NOTE: ties in the top-k go to the lower expert index (a stable sort), so the choice never
depends on the batch. The router scores in float32 at least (DeepSeek's reference does).

Two dispatches compute the same sum (within the rounding of matmuls over different row counts):
`by_expert` runs each chosen expert over the tokens that chose it, reading the choice back to
the host and grouping it there (numpy); on a CPU that read is free, on a device it is a
sync. `every_expert` runs every routed expert over every token, weighted by a [T, E] matrix
scattered from the choice (0 where not chosen): fixed shapes, nothing read back (no device
sync; the shapes a captured CUDA graph needs), at E / k times the expert FLOPs,
which a decode-sized batch on a GPU hardly notices (reading each expert's weights dominates)
and a large prefill chunk does (a grouped GEMM over expert-sorted rows would remove that).
`moe` takes `by_expert` where the host may read the device's tensors (`host_shortcuts`: a CPU
without DSV4_EMULATE_DEVICE=1), `every_expert` elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dsv4_common.core.model import DSV4Config
from dsv4_worker.mem.device import host_shortcuts
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
    chosen, weights = route(m, p, layer, x, ids)
    dispatch = by_expert if host_shortcuts(x.device) else every_expert
    out = dispatch(m, p, layer, x, chosen, weights)
    if f"{f}.shared_experts.w1.weight" in p:
        out = out + expert(x, p, f"{f}.shared_experts", m.arch.swiglu_limit)
    return out


def expert(x: torch.Tensor, p: Params, prefix: str, limit: float) -> torch.Tensor:
    """The SwiGLU expert whose weights are `{prefix}.w1/.w3/.w2.weight` over `x` [T, H]."""
    return swiglu(x, p, f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight", limit)


def by_expert(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H], each chosen expert over the rows that chose
    it, in ascending expert order (reads the choice on the host: a sync per read on a
    device)."""
    e_ = f"layers.{layer}.ffn.experts"
    limit = m.arch.swiglu_limit
    k = chosen.shape[1]
    flat = chosen.cpu().numpy().ravel()
    order = np.argsort(flat, kind="stable")  # (row, slot) pairs grouped by expert, rows ascending
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, len(order))
    w = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e, lo, hi in zip(experts.tolist(), bounds[:-1], bounds[1:], strict=True):
        picks = order[lo:hi]
        rows, slot = picks // k, torch.from_numpy(picks % k)
        if len(rows) == len(x) and (len(x) == 1 or bool((np.diff(rows) > 0).all())):
            # every row chose e once (always so for one decode token): no gather, no scatter
            out += expert(x, p, f"{e_}.{e}", limit) * w.gather(1, slot[:, None])
            continue
        index = torch.from_numpy(rows)
        y = expert(x[index], p, f"{e_}.{e}", limit)
        out.index_add_(0, index, y * w[index, slot, None])
    return out


def every_expert(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The same sum at fixed shapes: every routed expert over every row, times the row's
    routing weight for it (a token listing an expert twice gets both weights), in ascending
    expert order; where a row did not choose an expert its output is dropped, not multiplied
    by 0 (an inf there would make a NaN). Reads nothing back."""
    e_ = f"layers.{layer}.ffn.experts"
    limit = m.arch.swiglu_limit
    shape = (x.shape[0], m.weights.num_routed_experts)
    coef = torch.zeros(shape, dtype=weights.dtype, device=x.device)
    coef = coef.scatter_add_(1, chosen, weights).to(x.dtype)
    picked = torch.zeros(shape, dtype=torch.bool, device=x.device).scatter_(1, chosen, True)
    out = torch.zeros_like(x)
    for e in range(shape[1]):
        y = expert(x, p, f"{e_}.{e}", limit)
        out += torch.where(picked[:, e, None], y * coef[:, e, None], 0.0)
    return out
