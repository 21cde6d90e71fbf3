"""DeepSeek-V4's mixture of experts: a router scores every routed expert (sqrtsoftplus,
softmax or sigmoid of the gate's logits); top-k layers pick the k best by score plus the
correction bias (`gate.bias`, which steers the choice but not the weights), hash layers take
the k experts a fixed token-id table (`gate.tid2eid`) lists. The chosen experts' scores,
normalized to sum 1 (norm_topk_prob) and times routed_scaling_factor, weight their SwiGLU
outputs (clamped at swiglu_limit); the shared experts add to every token.

NOTE: ties in the top-k go to the lower expert index (a stable sort), so the choice never
depends on the batch. The router scores in float32 at least (DeepSeek's reference does).

The dispatches compute the same sum (within the rounding of matmuls over different row counts):
- `by_expert` runs each chosen expert over the tokens that chose it, reading the choice back to
  the host and grouping it there (numpy); on a CPU that read is free, on a device it is a sync.
- The device's, which read nothing back (no sync; fixed shapes, as a captured CUDA graph needs)
  and compute only the chosen (token, expert) pairs, on the experts' stacked stored bytes
  (`Params.experts`): `by_slot` while the N * k (token, slot) pairs are no more than the E
  experts (decode batches), gathering and dequantizing each pair's expert (N * k experts, not
  E) for one batched product a pair; `grouped` beyond, dequantizing every expert once and
  running one grouped GEMM over the pairs sorted by expert.
- `every_expert` runs every expert over every token, weighted by a [T, E] matrix scattered
  from the choice: E / k times the expert FLOPs and every expert dequantized each step. The
  device falls back to it only where the others cannot run (experts that do not stack, or a
  grouped GEMM the device lacks for the dtype).
`moe` takes `by_expert` where the host may read the device's tensors (`host_shortcuts`: a CPU
without DSV4_EMULATE_DEVICE=1), `on_device` elsewhere.

NOTE: the device dispatches bound the experts they hold dequantized at once to
`EXPERT_SCRATCH_BYTES` (chunks of pairs or of experts; sizes come from shapes, never from
the choice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch
import torch.nn.functional as F

from dsv4_common.core.model import DSV4Config
from dsv4_worker.mem.device import host_shortcuts
from dsv4_worker.model.compute import at_least_float32
from dsv4_worker.model.ops import gated, swiglu
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
    dispatch = by_expert if host_shortcuts(x.device) else on_device
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
    if len(x) == 1:  # one decode token: its k experts in ascending order, no grouping
        named: list[int] = chosen[0].tolist()
        w = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for j in sorted(range(k), key=named.__getitem__):  # stable: as the grouping orders
            out += expert(x, p, f"{e_}.{named[j]}", limit) * w[:, j : j + 1]
        return out
    flat = chosen.cpu().numpy().ravel()
    order = np.argsort(flat, kind="stable")  # (row, slot) pairs grouped by expert, rows ascending
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, len(order))
    w = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e, lo, hi in zip(experts.tolist(), bounds[:-1], bounds[1:], strict=True):
        picks = order[lo:hi]
        rows, slot = picks // k, torch.from_numpy(picks % k)
        if len(rows) == len(x) and bool((np.diff(rows) > 0).all()):
            # every row chose e once: no gather, no scatter
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


EXPERT_SCRATCH_BYTES: Final = 1 << 30  # dequantized experts of one matrix held at once
MATRICES: Final = ("w1", "w3", "w2")  # gate, up, down


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # batched or grouped matmul


@dataclass(frozen=True, slots=True)
class Experts:
    """One layer's routed experts as the device dispatches read them."""

    p: Params
    w1: tuple[str, ...]  # gate, one name an expert (expert order)
    w3: tuple[str, ...]  # up
    w2: tuple[str, ...]  # down
    limit: float  # the SwiGLU clamp
    chunk: int  # experts dequantized at once (a bound on the scratch)

    def gated(self, x: torch.Tensor, index: torch.Tensor | slice, mm: Product) -> torch.Tensor:
        """silu(x W1^T) * (x W3^T) with the experts at `index`, through `mm`."""
        g = mm(x, self.p.experts(self.w1, index).transpose(1, 2))
        return gated(g, mm(x, self.p.experts(self.w3, index).transpose(1, 2)), self.limit)

    def down(self, h: torch.Tensor, index: torch.Tensor | slice, mm: Product) -> torch.Tensor:
        return mm(h, self.p.experts(self.w2, index).transpose(1, 2))


def on_device(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    scratch_bytes: int = EXPERT_SCRATCH_BYTES,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] without reading the choice back: `by_slot`,
    `grouped`, or `every_expert` where neither can run."""
    w1, w3, w2 = expert_names(m, layer)
    stacks = [p.stack(n) for n in (w1, w3, w2)]
    if any(s is None for s in stacks):
        return every_expert(m, p, layer, x, chosen, weights)
    per_expert = max(s.rows * s.cols for s in stacks if s is not None) * x.element_size()
    chunk = max(1, scratch_bytes // per_expert)
    experts = Experts(p, w1, w3, w2, m.arch.swiglu_limit, chunk)
    if chosen.numel() <= len(w1):
        per_pair = by_slot(experts, x, chosen)
    elif grouped_mm_runs(x, m):
        per_pair = grouped(experts, x, chosen)
    else:
        return every_expert(m, p, layer, x, chosen, weights)
    # sum over slots of each pair's output times its routing weight, in x's dtype
    return (per_pair.view(*chosen.shape, -1) * weights.to(x.dtype)[:, :, None]).sum(dim=1)


def expert_names(m: DSV4Config, layer: int) -> tuple[tuple[str, ...], ...]:
    """The routed experts' weight names of `layer`, one tuple (expert order) per matrix."""
    return _expert_names(layer, m.weights.num_routed_experts)


@functools.cache
def _expert_names(layer: int, num: int) -> tuple[tuple[str, ...], ...]:
    # Built once: every decode step asks for them (3 x 256 names a layer on Flash, 130 us).
    return tuple(
        tuple(f"layers.{layer}.ffn.experts.{e}.{w}.weight" for e in range(num)) for w in MATRICES
    )


def hold_stacked(m: DSV4Config, p: Params) -> None:
    """Holds every MoE layer's routed experts in `p` as the stacks `on_device` reads: at
    load, before the KV pools take the device's memory, so that the one stack being copied
    at a time fits beside the weights."""
    experts = (n for n in p.names() if n.startswith("layers.") and ".ffn.experts." in n)
    for layer in sorted({int(n.split(".")[1]) for n in experts}):
        for names in expert_names(m, layer):
            if all(n in p for n in names):
                p.stack(names)


def by_slot(experts: Experts, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each (token, slot) pair times its own gathered expert: [N * k] experts dequantized (in
    chunks of `chunk` pairs), one batched one-row product a pair per matrix. The pairs'
    outputs [N * k, H], in pair order."""
    flat = chosen.reshape(-1)
    rows = x.repeat_interleave(chosen.shape[1], dim=0).unsqueeze(1)  # [N * k, 1, H]
    out = torch.empty_like(rows)
    for lo in range(0, flat.shape[0], experts.chunk):
        index, part = flat[lo : lo + experts.chunk], rows[lo : lo + experts.chunk]
        out[lo : lo + experts.chunk] = experts.down(
            experts.gated(part, index, torch.bmm), index, torch.bmm
        )
    return out.squeeze(1)


def grouped(experts: Experts, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The (token, slot) pairs sorted by expert, every expert dequantized once (`chunk` at a
    time), one grouped GEMM per matrix and chunk over the pairs that chose its experts. The
    pairs' outputs [N * k, H], in pair order."""
    num, pairs = len(experts.w1), chosen.numel()
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, then in pair order
    counts = torch.zeros(num, dtype=torch.int64, device=x.device)
    ends = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0)  # [E]: ends of groups
    rows = x.index_select(0, order // chosen.shape[1])  # [pairs, H], sorted
    out = torch.empty(pairs + 1, x.shape[1], dtype=x.dtype, device=x.device)  # + a dump row
    position = torch.arange(pairs, device=x.device)
    for lo in range(0, num, experts.chunk):
        chunk = slice(lo, min(lo + experts.chunk, num))
        if lo == 0:  # the chunk's pairs come first in sorted order
            part, at, offs = rows, position, ends[chunk]
        else:  # rotate the chunk's pairs to the front: the GEMM skips rows past its last group
            at = (position + ends[lo - 1]) % pairs
            part, offs = rows.index_select(0, at), ends[chunk] - ends[lo - 1]
        offs = offs.to(torch.int32)

        def mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor = offs) -> torch.Tensor:
            return F.grouped_mm(a, b, offs=offs)

        y = experts.down(experts.gated(part, chunk, mm), chunk, mm)
        mine = torch.where(position < offs[-1], at, pairs)  # rows past the chunk: the dump row
        out.index_copy_(0, mine, y)
    return torch.empty_like(rows).index_copy_(0, order, out[:pairs])


def grouped_mm_runs(x: torch.Tensor, m: DSV4Config) -> bool:
    """Whether `F.grouped_mm` takes `x`'s dtype and the experts' shapes on `x`'s device: on a
    CPU float32/bfloat16/float16, on CUDA bfloat16 from compute capability 8.0; every row a
    multiple of 16 bytes."""
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    dims = (m.weights.hidden_size, m.weights.moe_intermediate_size)
    return all(d * x.element_size() % 16 == 0 for d in dims)
