"""Sampling parameters (frozen) and the sampler: greedy, or temperature with top-k / top-p /
min-p, seeded per request so a seed reproduces its tokens; logit processors before either.

The order is vLLM's (its V1 sampler), on the model's logits for one request:

    1. min_tokens   while fewer than `min_tokens` tokens are out, `stop_token_ids` get -inf
    2. logit_bias   logits[id] += bias
    3. penalties    repetition (tokens of the prompt or the output: a positive logit is
                    divided by it, a negative one multiplied), then frequency (times the
                    token's count in the output) and presence (once per token in the output)
                    are subtracted
    4. grammar      a request with a `json_schema` keeps only the tokens its matcher
                    allows (`grammar.py`: the engine applies it, batched)
    5. greedy: argmax; else temperature, then min-p, top-k and top-p, then one draw

Logprobs never see these steps: they come from the raw logits (`logprobs.py`). The engine
runs steps 1-3 batched over a step's requests (`penalties.py`, equal to `adjust` bit for bit),
then `draw`; `sample` is the same for one request.

Degenerate values (every accepted one is served; none divides into inf or NaN):

    temperature < TEMPERATURE_FLOOR           greedy (no generator: as temperature 0)
    repetition_penalty < REPETITION_FLOOR     counts as REPETITION_FLOOR (a positive logit
                                              divided by less could overflow float64; the
                                              seen tokens win outright either way)
    step 5 scales (scores - max) / temperature: the best token at 0, the rest <= 0, so a
    large score or a small temperature underflows to -inf (probability 0), never to +inf
    no token left (the grammar and min_tokens exclude every one)   NoTokenAllowed
    NaN or +inf scores (a broken forward, never a parameter)        NoTokenAllowed
The engine fails that one request (`loop.py`); the others of its batch go on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv4_worker.engine.logprobs import MAX_TOP_LOGPROBS
from dsv4_worker.mem.device import host_shortcuts

# Below this a temperature samples greedily (vLLM's sampling epsilon): 1/T would scale a
# logit gap of one float32 ulp past the float64 range long before T reaches a denormal.
TEMPERATURE_FLOOR = 1e-5
# Below this a repetition penalty counts as this: logits (float32 range, plus a bias of at
# most 100) divided by it stay finite in float64 with room to spare for 1/temperature.
REPETITION_FLOOR = 1e-200


class NoTokenAllowed(ValueError):
    """The request's scores leave no token to pick (every one is -inf, or they hold NaN)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # end generation (the request's, then EOS)
    min_p: float = 0.0  # 0 = off
    min_tokens: int = 0  # stop ids cannot be sampled before this many tokens are out
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # None: none; k: each sampled token's and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    json_schema: str | None = None  # the grammar of the output (JSON schema or Lark): grammar.py

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature={self.temperature} must be in [0, 100]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2]")
        for token, bias in self.logit_bias:
            if token < 0 or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias {token}: {bias} must be a token id and in [-100, 100]"
                )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name}={k} must be in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        """Argmax, no generator: temperature 0 or below `TEMPERATURE_FLOOR`."""
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def repetition_factor(self) -> float:
        """The repetition penalty as applied (`REPETITION_FLOOR` at least)."""
        return max(self.repetition_penalty, REPETITION_FLOOR)

    @property
    def processed(self) -> bool:
        """Whether a logit processor (steps 1-3) can change this request's logits."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.seed() % (1 << 63)))
    return gen


def adjust(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> torch.Tensor:
    """Steps 1-3 on logits [vocab] (a float64 copy; unchanged values when nothing applies)."""
    scores = logits.to(torch.float64)
    if not params.processed:
        return scores
    scores = scores.clone()
    vocab, dev = scores.shape[-1], scores.device
    if len(output) < params.min_tokens and params.stop_token_ids:
        stops = [t for t in params.stop_token_ids if t < vocab]
        scores[torch.tensor(stops, dtype=torch.long, device=dev)] = float("-inf")
    if params.logit_bias:
        pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=dev)
        scores.index_add_(
            0, ids, torch.tensor([b for _, b in pairs], dtype=scores.dtype, device=dev)
        )
    out = torch.tensor(list(output), dtype=torch.long, device=dev)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(list(prompt), dtype=torch.long, device=dev)] = True
        seen[out] = True
        p = params.repetition_factor
        scores = torch.where(seen, torch.where(scores > 0, scores / p, scores * p), scores)
    if (params.frequency_penalty or params.presence_penalty) and len(output):
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(scores.dtype)
        present = (counts > 0).to(scores.dtype)
        scores -= params.frequency_penalty * counts + params.presence_penalty * present
    return scores


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator | None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> int:
    """One token from logits [vocab], given the request's prompt and output so far (for the
    penalties and min_tokens). The engine runs steps 1-3 batched (`penalties.py`), then
    `draw`; this is the same for one request."""
    return draw(adjust(logits, params, prompt, output), params, gen)


def draw(scores: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Step 5 on scores [vocab] that went through steps 1-4 (or need none). Raises
    NoTokenAllowed when no token has a finite score, or a score is NaN or +inf (one host
    sync either way: the token and that check come back together)."""
    scores = scores.to(torch.float64)
    top = scores.max()  # NaN when any score is (torch's max propagates it)
    finite = top.isfinite()
    if params.greedy or gen is None:
        token = scores.argmax()
    else:
        token = _sample(scores, top, finite, params, gen)
    picked, ok = torch.stack([token, finite.to(token.dtype)]).tolist()
    if not ok:
        raise NoTokenAllowed(_why_none(float(top)))
    return int(picked)


def _sample(
    scores: torch.Tensor,
    top: torch.Tensor,
    finite: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator,
) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p and one draw; a row without a finite maximum draws
    from a placeholder (the caller refuses its token), never from NaN probabilities."""
    scores = (scores - top) / params.temperature  # <= 0: no overflow (module docstring)
    if params.min_p > 0:  # relative to the most likely token, before top-k / top-p (vLLM)
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # at least the top one
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    probs = torch.where(finite, probs, torch.ones_like(probs))
    return torch.multinomial(probs, 1, generator=gen)[0]


def _why_none(top: float) -> str:
    if top == -math.inf:
        return "no token is allowed here (every score is -inf)"
    return f"the logits hold {top} (a broken forward)"


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, for logits [batch, vocab]: the first maximum, a NaN counting as the
    maximum (torch.argmax's rule). On CPU, float32/64 logits go through numpy's argmax, which
    keeps that rule and is several times faster than torch's CPU kernel at batch 1024 (not
    under DSV4_EMULATE_DEVICE=1, which takes CUDA's code: one read-back of the argmaxes)."""
    if host_shortcuts(logits.device) and logits.dtype in (torch.float32, torch.float64):
        rows: np.ndarray = logits.detach().numpy()
        out: list[int] = rows.argmax(axis=-1).tolist()
        return out
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    return tokens
