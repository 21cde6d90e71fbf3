"""Logprobs from the engine equal the log-softmax of the model's own logits (the oracle's,
recomputed here): each sampled token's and, with prompt logprobs, every prompt token's after
the first, across chunked prefill and batched with requests that ask for nothing; the logit
processors change the tokens as specified while the logprobs stay the raw model's."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine as make_engine

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.oracle import oracle_greedy, oracle_logits
from dsv4_worker.model.weights import init_weights

MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=33)
TOL = 2e-4  # float32 paged forward vs float64 oracle


def prompt(n: int, salt: int) -> list[int]:
    return [((29 * i + 11 * salt) % 250) + 3 for i in range(n)]


def engine(chunk: int = 24) -> Engine:
    return make_engine(MODEL, WEIGHTS, chunk=chunk)


def reference(req: Request) -> torch.Tensor:
    """log_softmax of the oracle's logits over the prompt and the output (but its last)."""
    ids = [*req.prompt, *req.output[:-1]]
    return torch.log_softmax(oracle_logits(MODEL, WEIGHTS, ids), dim=-1)


def check_logprobs(req: Request, k: int) -> None:
    ref = reference(req)
    n = len(req.prompt)
    assert len(req.logprobs) == len(req.output)
    for i, (token, entry) in enumerate(zip(req.output, req.logprobs, strict=True)):
        row = ref[n - 1 + i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=TOL)
        assert [t for t, _ in entry.top] == row.topk(k).indices.tolist()
    if req.params.prompt_logprobs is not None:
        assert len(req.prompt_logprobs) == n - 1
        for j, entry in enumerate(req.prompt_logprobs):
            assert entry.token_id == req.prompt[j + 1]
            assert entry.logprob == pytest.approx(float(ref[j][req.prompt[j + 1]]), abs=TOL)
            assert len(entry.top) == req.params.prompt_logprobs


def test_logprobs_equal_the_models_log_softmax_across_chunks_and_batches() -> None:
    eng = engine(chunk=24)
    scored = eng.submit(
        prompt(70, 1), SamplingParams(max_new_tokens=6, logprobs=3, prompt_logprobs=2)
    )  # three chunks of prompt
    plain = eng.submit(prompt(33, 2), SamplingParams(max_new_tokens=5))
    sampled = eng.submit(
        prompt(9, 3), SamplingParams(max_new_tokens=7, temperature=1.0, seed=5, logprobs=0)
    )
    one = eng.submit(prompt(1, 4), SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    eng.run_until_idle()
    check_logprobs(scored, 3)
    check_logprobs(sampled, 0)
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    assert one.prompt_logprobs == [] and one.logprobs == []  # a one-token prompt has none
    assert plain.output == oracle_greedy(MODEL, WEIGHTS, plain.prompt, 5)
    assert scored.output == oracle_greedy(MODEL, WEIGHTS, scored.prompt, 6)
    assert all(u.used == 0 for u in eng.mem.usage())


def test_processors_change_tokens_not_logprobs() -> None:
    """A ban on the greedy tokens changes the output; the logprobs stay the model's, and
    min_tokens keeps a stop id that would end at once from ending early."""
    p = prompt(20, 7)
    free = oracle_greedy(MODEL, WEIGHTS, p, 6)
    eng = engine()
    banned = eng.submit(
        p,
        SamplingParams(
            max_new_tokens=6, logprobs=1, logit_bias=tuple((t, -100.0) for t in set(free))
        ),
    )
    held = eng.submit(p, SamplingParams(max_new_tokens=8, stop_token_ids=(free[0],), min_tokens=4))
    stopped = eng.submit(p, SamplingParams(max_new_tokens=8, stop_token_ids=(free[0],)))
    eng.run_until_idle()
    assert not set(banned.output) & set(free)
    check_logprobs(banned, 1)
    assert stopped.output == [free[0]] and stopped.finish_reason == "stop"
    assert len(held.output) >= 4 and free[0] not in held.output[:4]
    assert held.finish_reason == ("stop" if held.output[-1] == free[0] else "length")
