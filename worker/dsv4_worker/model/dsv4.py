"""DeepSeek-V4 at the level of blocks: the embedding spread over the residual streams, one
decoder block (attention and MoE, each wrapped in hyper-connections), and the head. The
attention itself is passed in: the naive oracle and the paged engine compute it from the same
pieces (attention.py, compressor.py, indexer.py) but keep its KV state differently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model import hyper
from dsv4_worker.model.moe import moe
from dsv4_worker.model.ops import rms_norm
from dsv4_worker.model.params import Params

Attention = Callable[[torch.Tensor], torch.Tensor]  # normalized input [T, H] -> [T, H]


def embed(m: DSV4Config, p: Params, ids: torch.Tensor) -> torch.Tensor:
    """Token ids [T] -> residual streams [T, hc, H] (every stream starts as the embedding), in
    the compute dtype."""
    e = p.rows("embed.weight", ids)
    return e.unsqueeze(1).expand(-1, m.arch.hc_mult, -1).contiguous()


def block(
    m: DSV4Config, p: Params, layer: int, h: torch.Tensor, ids: torch.Tensor, attn: Attention
) -> torch.Tensor:
    """One decoder block over streams `h` [T, hc, H]; `ids` [T] feed hash routing."""
    a, pre = m.arch, f"layers.{layer}"
    eps = a.rms_norm_eps
    mix_in, post, comb = hyper.mixes(h, p, f"{pre}.hc_attn", a)
    x = rms_norm(hyper.collapse(h, mix_in), p.vector(f"{pre}.attn_norm.weight"), eps)
    h = hyper.expand(attn(x), h, post, comb)
    mix_in, post, comb = hyper.mixes(h, p, f"{pre}.hc_ffn", a)
    x = rms_norm(hyper.collapse(h, mix_in), p.vector(f"{pre}.ffn_norm.weight"), eps)
    return hyper.expand(moe(m, p, layer, x, ids), h, post, comb)


def logits(m: DSV4Config, p: Params, h: torch.Tensor) -> torch.Tensor:
    """Streams [T, hc, H] -> logits [T, vocab]."""
    x = rms_norm(hyper.head(h, p, m.arch), p.vector("norm.weight"), m.arch.rms_norm_eps)
    return p.linear(x, "head.weight")
