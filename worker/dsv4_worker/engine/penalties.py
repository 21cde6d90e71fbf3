"""The sampler's logit processors (`sampler.py`'s steps 1-3: min_tokens, logit_bias, the
repetition, frequency and presence penalties) batched over the requests of one step that use
them: one gather of their rows and a handful of [rows, vocab] operations, whatever their
number. Requests that use none cost nothing (they are not in the batch).

The penalties need each request's token counts; `TokenCounts` keeps them incrementally (the
tokens sampled since its last step are added, the prompt is read once), so a step never
rebuilds them from the request's token lists. The result equals `sampler.adjust` row by row,
bit for bit (test_penalties_batched.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsv4_worker.engine.sampler import SamplingParams


@dataclass(slots=True)
class TokenCounts:
    """One request's distinct tokens so far with how often each is in its output: the only
    entries of its logits a penalty changes. Entries [0, prompt_size) are the prompt's (kept
    for a repetition penalty only), then each new output token gets one; tensors on the
    logits' device, written only where a step adds tokens."""

    ids: torch.Tensor  # [capacity] int64: the distinct tokens, in order of first appearance
    output_counts: torch.Tensor  # [capacity] float64: occurrences in the output
    position: dict[int, int]  # token id -> its entry
    prompt_size: int
    size: int  # entries in use
    counted: int = 0  # output tokens already in `output_counts`

    @classmethod
    def new(
        cls, params: SamplingParams, prompt: Sequence[int], device: torch.device
    ) -> TokenCounts:
        distinct = list(dict.fromkeys(prompt)) if params.repetition_penalty != 1.0 else []
        capacity = len(distinct) + params.max_new_tokens
        ids = torch.zeros(capacity, dtype=torch.long, device=device)
        ids[: len(distinct)] = torch.tensor(distinct, dtype=torch.long)
        counts = torch.zeros(capacity, dtype=torch.float64, device=device)
        position = {t: i for i, t in enumerate(distinct)}
        return cls(ids, counts, position, len(distinct), len(distinct))

    def catch_up(self, output: Sequence[int]) -> None:
        """Count the output tokens added since the last call (usually one)."""
        if len(output) == self.counted:
            return
        entries = []
        for token in output[self.counted :]:
            entry = self.position.get(token)
            if entry is None:
                entry = self.position[token] = self.size
                if self.size == self.ids.numel():  # more output than planned (never in the engine)
                    self._grow()
                self.ids[entry] = token
                self.size += 1
            entries.append(entry)
        at = torch.tensor(entries, dtype=torch.long, device=self.ids.device)
        self.output_counts.index_put_((at,), torch.ones_like(at, dtype=torch.float64), True)
        self.counted = len(output)

    def _grow(self) -> None:
        self.ids = torch.cat([self.ids, torch.zeros_like(self.ids)])
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])


class Processed(NamedTuple):
    """One request of the batch: its logits row, parameters, tokens and counts."""

    row: int
    params: SamplingParams
    output: Sequence[int]
    counts: TokenCounts | None  # required when the request has a penalty


def penalized(params: SamplingParams) -> bool:
    """Whether the request needs token counts (a repetition, frequency or presence penalty)."""
    return bool(
        params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
    )


def apply_processors(logits: torch.Tensor, batch: Sequence[Processed]) -> torch.Tensor:
    """Steps 1-3 for every request of `batch` at once: [len(batch), vocab] float64 scores,
    row k for batch[k] (its logits row `batch[k].row` of `logits` [rows, vocab])."""
    dev, vocab = logits.device, logits.shape[-1]
    if [p.row for p in batch] == list(range(logits.shape[0])):  # every row, in order
        scores = logits.to(torch.float64, copy=True)
    else:
        rows = torch.tensor([p.row for p in batch], dtype=torch.long, device=dev)
        scores = logits.index_select(0, rows).to(torch.float64)
    # 1. min_tokens: the stop ids of rows still short of their minimum
    at = [
        (k, t)
        for k, p in enumerate(batch)
        if len(p.output) < p.params.min_tokens
        for t in p.params.stop_token_ids
        if t < vocab
    ]
    if at:
        index = torch.tensor(at, dtype=torch.long, device=dev).T
        scores[index[0], index[1]] = float("-inf")
    # 2. logit_bias, added (a token named twice gets both)
    biased = [(k, t, b) for k, p in enumerate(batch) for t, b in p.params.logit_bias if t < vocab]
    if biased:
        index = torch.tensor([(k, t) for k, t, _ in biased], dtype=torch.long, device=dev).T
        bias = torch.tensor([b for _, _, b in biased], dtype=torch.float64, device=dev)
        scores.index_put_((index[0], index[1]), bias, accumulate=True)
    # 3. penalties over the rows that have one: repetition, then frequency and presence
    with_counts = [k for k, p in enumerate(batch) if penalized(p.params)]
    if with_counts:
        _penalize(scores, [batch[k] for k in with_counts], with_counts)
    return scores


def _penalize(scores: torch.Tensor, batch: Sequence[Processed], rows: Sequence[int]) -> None:
    """In place on `scores` rows `rows` (for batch[k] at rows[k]): only each request's seen
    tokens are gathered, changed and written back."""
    dev = scores.device
    counts: list[TokenCounts] = []
    for p in batch:
        assert p.counts is not None, "a penalized request keeps token counts"
        p.counts.catch_up(p.output)
        counts.append(p.counts)
    sizes = torch.tensor([c.size for c in counts], dtype=torch.long, device=dev)

    def per_entry(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=scores.dtype, device=dev).repeat_interleave(sizes)

    row = torch.tensor(rows, dtype=torch.long, device=dev).repeat_interleave(sizes)
    ids = torch.cat([c.ids[: c.size] for c in counts])
    found = torch.cat([c.output_counts[: c.size] for c in counts])
    values = scores[row, ids]  # the one gather
    # Every entry is a seen token (prompt or output); a factor of 1 leaves a value as it is.
    factor = per_entry([p.params.repetition_factor for p in batch])
    values = torch.where(values > 0, values / factor, values * factor)
    per_count = per_entry([p.params.frequency_penalty for p in batch])
    once = per_entry([p.params.presence_penalty for p in batch])
    values -= per_count * found + once * (found > 0)  # one subtraction, as `adjust`
    scores[row, ids] = values  # the one scatter (a row's ids are distinct)
