"""Manifold-constrained hyper-connections: DeepSeek-V4 keeps `hc_mult` residual streams per
token ([T, hc, H]). Before each sub-block (attention, FFN) a small projection of the
normalized streams gives three mixes: `pre` collapses the streams into the block's input,
`post` spreads the block's output back over the streams, and `comb` (made doubly stochastic
by Sinkhorn iterations) mixes the old streams into the new:

    new[k] = post[k] * out + sum_j comb[j, k] * streams[j]

The head collapses the streams once more (`pre` only) before the final norm. The mixes are
computed in float32 at least (as DeepSeek's reference and transformers do) and applied in the
streams' dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_common.core.model import DSV4Arch
from dsv4_worker.mem.device import host_shortcuts
from dsv4_worker.model.compute import at_least_float32
from dsv4_worker.model.ops import rms_norm
from dsv4_worker.model.params import Params

Mixes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # pre [T, hc], post [T, hc], comb
_sum = np.add.reduce  # ndarray.sum without its Python wrapper


def mixes(streams: torch.Tensor, p: Params, prefix: str, a: DSV4Arch) -> Mixes:
    """(pre, post, comb) of one sub-block from its `{prefix}_fn/_base/_scale` parameters, in
    float32 at least."""
    t, hc, _ = streams.shape
    hi = at_least_float32(streams.dtype)
    flat = rms_norm(streams.reshape(t, -1).to(hi), None, a.rms_norm_eps)
    raw = p.linear(flat, f"{prefix}_fn")
    base, scale = p.vector(f"{prefix}_base", hi), p.vector(f"{prefix}_scale", hi)
    pre = torch.sigmoid(raw[:, :hc] * scale[0] + base[:hc]) + a.hc_eps
    post = 2 * torch.sigmoid(raw[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = raw[:, 2 * hc :] * scale[2] + base[2 * hc :]
    comb = torch.softmax(logits.view(t, hc, hc), dim=-1) + a.hc_eps
    return pre, post, sinkhorn(comb, a.hc_sinkhorn_iters, a.hc_eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalization of [T, hc, hc] (columns first and last).

    NOTE: on CPU without autograd the iterations run in numpy (not under DSV4_EMULATE_DEVICE=1,
    which takes CUDA's code): the same float operations in the same order (equal to torch's to
    a few ulps: the two libraries' reductions are different kernels), at a third of torch's
    per-call cost on these tiny matrices, which dominate a decode step's op count (4 ops x 2 x
    iters per sub-block)."""
    if host_shortcuts(comb.device) and not comb.requires_grad:
        x = comb.numpy()
        # eps as the sum's initial term: two numpy calls a normalization, not three (the
        # same terms; only where eps joins the sum differs, by an ulp at most)
        x = x / _sum(x, axis=-2, keepdims=True, initial=eps)
        for _ in range(iters - 1):
            x /= _sum(x, axis=-1, keepdims=True, initial=eps)
            x /= _sum(x, axis=-2, keepdims=True, initial=eps)
        return torch.from_numpy(x)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, hc, H] -> [T, H], weighted by `pre` (in its dtype; the result in the streams')."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The new streams [T, hc, H] from a sub-block's output [T, H] and the old streams."""
    dtype = streams.dtype
    if post.dtype != dtype:
        post, comb = post.to(dtype), comb.to(dtype)
    # new[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * streams[t, j]: one batched product
    return torch.baddbmm(post.unsqueeze(-1) * out.unsqueeze(1), comb.transpose(1, 2), streams)


def head(streams: torch.Tensor, p: Params, a: DSV4Arch) -> torch.Tensor:
    """The head's collapse of the streams [T, hc, H] -> [T, H]."""
    t = streams.shape[0]
    hi = at_least_float32(streams.dtype)
    flat = rms_norm(streams.reshape(t, -1).to(hi), None, a.rms_norm_eps)
    raw = p.linear(flat, "hc_head_fn")
    scale, base = p.vector("hc_head_scale", hi), p.vector("hc_head_base", hi)
    pre = torch.sigmoid(raw * scale + base) + a.hc_eps
    return collapse(streams, pre)
