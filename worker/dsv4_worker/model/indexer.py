"""The lightning indexer of DeepSeek-V4's compressed sparse attention (CSA) layers: each query
scores every complete compressed block with sum_h w_h relu(q_h . k) / sqrt(dim) (w = the
head weights from the token, scaled by 1/sqrt(n_heads); q from the query latent, rotated by
the compress rope like the indexer's own compressed keys) and attends to the top index_topk.
Where the keys are stored quantized (fp8), queries and keys are first rotated by the same
orthonormal Hadamard matrix, as DeepSeek's reference does before its quantization: scores are
unchanged in exact arithmetic, and the rotation spreads outliers before the keys are rounded.

NOTE (tie rule): equal scores go to the lower block index (a stable sort, whatever the number
of blocks), so colocated, PD and PP select the same blocks. transformers' torch.topk leaves
ties unspecified; see docs/real-model.md.
"""

from __future__ import annotations

import torch

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model.kv_quant import hadamard, quantized_index_keys
from dsv4_worker.model.params import Params
from dsv4_worker.model.rope import rotate as rope_rotate


def query(
    m: DSV4Config,
    p: Params,
    layer: int,
    x: torch.Tensor,
    latent: torch.Tensor,
    positions: torch.Tensor,
    freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [T, n_heads, dim] (rotated) and head weights [T, n_heads]."""
    i = f"layers.{layer}.attn.indexer"
    q = p.linear(latent, f"{i}.wq_b.weight").view(len(x), m.index_n_heads, m.index_head_dim)
    w = p.linear(x, f"{i}.weights_proj.weight") * m.index_n_heads**-0.5
    return rotate(m, rope_rotate(q, positions, freq)), w


def rotate(m: DSV4Config, x: torch.Tensor) -> torch.Tensor:
    """Indexer queries or keys [..., index_head_dim] as scored: Hadamard-rotated where the
    keys are stored quantized, unchanged otherwise (float keys need no rotation)."""
    return hadamard(x) if quantized_index_keys(m) else x


def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores [T, C] of compressed rows with indexer keys [C, dim]."""
    dots = torch.relu(torch.matmul(q, keys.t())) * q.shape[-1] ** -0.5
    return _weighted(w, dots)


def row_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`scores` for tokens with keys of their own: keys [T, C, dim] -> scores [T, C]."""
    dots = torch.relu(torch.bmm(q, keys.transpose(1, 2))) * q.shape[-1] ** -0.5
    return _weighted(w, dots)


def _weighted(w: torch.Tensor, dots: torch.Tensor) -> torch.Tensor:
    """sum_h w[t, h] * dots[t, h, c] -> [T, C] (a batched product: einsum's own plan for it,
    without einsum's per-call parsing)."""
    return torch.bmm(w.unsqueeze(1), dots).squeeze(1)


def top_k_mask(scores: torch.Tensor, available: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the (at most) k available entries with the highest scores [T, C] -> bool."""
    if scores.shape[-1] == 0:
        return available
    masked = scores.masked_fill(~available, float("-inf"))
    kk = min(k, scores.shape[-1])
    top = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :kk]
    chosen = torch.zeros_like(available).scatter_(-1, top, True)
    return chosen & available
