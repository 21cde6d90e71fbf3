"""Sampling parameters (frozen) and the sampler: greedy, or temperature with top-k / top-p,
seeded per request so a seed reproduces its tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature={self.temperature} must be in [0, 100]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.seed() % (1 << 63)))
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from logits [vocab]."""
    if params.temperature == 0 or gen is None:
        return int(logits.argmax())
    scores = logits.to(torch.float64) / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # at least the top one
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, for logits [batch, vocab]: the first maximum, a NaN counting as the
    maximum (torch.argmax's rule). On CPU, float32/64 logits go through numpy's argmax, which
    keeps that rule and is several times faster than torch's CPU kernel at batch 1024."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        rows: np.ndarray = logits.detach().numpy()
        out: list[int] = rows.argmax(axis=-1).tolist()
        return out
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    return tokens
