"""Log probabilities of tokens, computed from the model's raw logits (before any penalty, bias,
temperature or truncation: vLLM's default `raw_logprobs`), and the row layout of a forward
that also scores prompt tokens.

    logprob(token at position t+1) = log_softmax(logits at position t)[token]

A sampled token's entry comes from the logits it was sampled from; a prompt token's from the
logits at the position before it (the first prompt token has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives one position reports (OpenAI's chat limit)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """One entry per row of `logits` [rows, vocab]: the logprob of `token_ids[row]` and the
    `k` most likely tokens of that row."""
    assert logits.shape[0] == len(token_ids), "one token per row"
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(token_ids), device=lp.device)[:, None])[:, 0]
    chosen_values: list[float] = chosen.tolist()
    if k == 0:
        return [TokenLogprob(t, v) for t, v in zip(token_ids, chosen_values, strict=True)]
    top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    ids: list[list[int]] = top.indices.tolist()
    values: list[list[float]] = top.values.tolist()
    return [
        TokenLogprob(t, v, tuple(zip(i, vs, strict=True)))
        for t, v, i, vs in zip(token_ids, chosen_values, ids, values, strict=True)
    ]


def row_layout(lengths: Sequence[int], every: Sequence[bool]) -> list[tuple[int, int]]:
    """Rows [first, last] of each segment in a forward's logits, where a segment with `every`
    set has a row per token and the others one row (their last token)."""
    out: list[tuple[int, int]] = []
    row = 0
    for n, all_rows in zip(lengths, every, strict=True):
        rows = n if all_rows else 1
        out.append((row, row + rows - 1))
        row += rows
    return out
