"""The DSV4 compressors: each block of `ratio` tokens becomes one KV row (a per-channel softmax
over the block's scores, weighting the tokens' kv), normalised and rotated by the compress
rope at the block's first position. Parameters (published names, under `prefix`): `wkv` and
`wgate` project a token to its kv and score halves, `ape` [ratio, width] is the score bias of
each slot of a block, `norm` the row's RMS gain.

Per-token state rows are what the layout's rings hold, score bias already added:

    overlapped (CSA, ratio == sparse ratio): [kv_prev | kv_curr | score_prev | score_curr]  4 dim
    plain (HCA):                             [kv | score]                                    2 dim

An overlapped row b mixes the `_prev` halves of block b-1's tokens with the `_curr` halves of
block b's (block 0 has no previous block). The online form of a plain compressor keeps
[running max | running sum | weighted kv] (3 rows of `dim`) instead of the block's tokens:
exact, one row per request instead of `ratio`.

NOTE: the compressors compute in float32 at least (float64 when the model does), whatever the
activations' dtype, as DeepSeek's reference does ("compression need fp32").
"""

from __future__ import annotations

import torch

from dsv4_worker.model.compute import at_least_float32
from dsv4_worker.model.ops import rms_norm
from dsv4_worker.model.params import Params
from dsv4_worker.model.rope import rotate

ONLINE_ROWS = 3  # running max, running sum, weighted kv


def token_states(
    x: torch.Tensor,
    positions: torch.Tensor,
    params: Params,
    prefix: str,
    ratio: int,
) -> torch.Tensor:
    """State rows [T, 4*dim or 2*dim] for hidden states `x` [T, H] at `positions` [T], in
    float32 at least."""
    x = x.to(at_least_float32(x.dtype))
    kv = params.linear(x, f"{prefix}.wkv.weight")
    score = params.linear(x, f"{prefix}.wgate.weight") + params.rows(
        f"{prefix}.ape", positions % ratio, x.dtype
    )
    # Overlapped: [kv_prev | kv_curr] and [score_prev | score_curr] are the projections' two
    # halves (the first feeds the next block's row, the second this block's), so the row is
    # the plain [kv | score] concatenation in both forms.
    return torch.cat([kv, score], dim=-1)


def pool_block(prev: torch.Tensor | None, curr: torch.Tensor, overlap: bool) -> torch.Tensor:
    """The pooled (not yet normalised) row of one block from its tokens' state rows
    [ratio, width] (and the previous block's, for an overlapped compressor)."""
    if overlap:
        dim = curr.shape[-1] // 4
        kv, score = curr[:, dim : 2 * dim], curr[:, 3 * dim :]
        if prev is not None:
            kv = torch.cat([prev[:, :dim], kv])
            score = torch.cat([prev[:, 2 * dim : 3 * dim], score])
    else:
        dim = curr.shape[-1] // 2
        kv, score = curr[:, :dim], curr[:, dim:]
    weights = torch.softmax(score, dim=0)
    return (weights * kv).sum(dim=0)


def pool_blocks(rows: torch.Tensor, valid: torch.Tensor, overlap: bool) -> torch.Tensor:
    """`pool_block` of N blocks at once: state rows [N, ratio, width] (overlapped: [N,
    2 * ratio, width], the previous block's first) where `valid` [N, ...] marks the rows that
    exist (block 0 has no previous block). Returns [N, dim]."""
    if overlap:
        dim, ratio = rows.shape[-1] // 4, rows.shape[1] // 2
        prev, curr = rows[:, :ratio], rows[:, ratio:]
        kv = torch.cat([prev[..., :dim], curr[..., dim : 2 * dim]], dim=1)
        score = torch.cat([prev[..., 2 * dim : 3 * dim], curr[..., 3 * dim :]], dim=1)
    else:
        dim = rows.shape[-1] // 2
        kv, score = rows[..., :dim], rows[..., dim:]
    weights = torch.softmax(score.masked_fill(~valid[..., None], float("-inf")), dim=1)
    return (weights * kv).sum(dim=1)


def finish_rows(
    pooled: torch.Tensor,
    blocks: torch.Tensor,
    ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    freq: torch.Tensor,
) -> torch.Tensor:
    """Normalise and rotate pooled rows [N, dim] of blocks `blocks` [N] (a compressed row sits
    at its block's first position)."""
    return rotate(rms_norm(pooled, norm_weight, eps), blocks * ratio, freq)


def online_update(state: torch.Tensor | None, token: torch.Tensor) -> torch.Tensor:
    """Fold one token's [kv | score] row into an online state [3, dim] (None: a new block)."""
    dim = token.shape[-1] // 2
    kv, score = token[:dim], token[dim:]
    if state is None:
        return torch.stack([score, torch.ones_like(score), kv])
    running_max, running_sum, acc = state
    new_max = torch.maximum(running_max, score)
    old_scale, new_scale = torch.exp(running_max - new_max), torch.exp(score - new_max)
    return torch.stack(
        [new_max, running_sum * old_scale + new_scale, acc * old_scale + new_scale * kv]
    )


def online_pooled(state: torch.Tensor) -> torch.Tensor:
    """The pooled row an online state holds at its block's end."""
    return state[2] / state[1]
