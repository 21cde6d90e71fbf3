"""The engine loop: scheduled batches equal the oracle token for token, also under memory
pressure that forces retraction (CPU offload) and resume and under SWA pressure that defers
chunks; requests that can never fit are rejected at once; every pool ends empty."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from engine_helpers import engine as make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_common.core.model import ModelConfig
from dsv4_common.core.presets import hybrid_tiny, tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.oracle import oracle_greedy
from dsv4_worker.model.weights import init_weights

WEIGHTS = {m.name: init_weights(m, seed=33) for m in (tiny(), hybrid_tiny())}


def engine(model: ModelConfig, **kw: int) -> Engine:
    return make_engine(model, WEIGHTS[model.name], **kw)


def prompt(n: int, salt: int) -> list[int]:
    return [((29 * i + 11 * salt) % 250) + 3 for i in range(n)]


def run(eng: Engine, prompts: Sequence[Sequence[int]], new: Sequence[int]) -> list[list[int]]:
    reqs = [
        eng.submit(list(p), SamplingParams(max_new_tokens=n))
        for p, n in zip(prompts, new, strict=True)
    ]
    eng.run_until_idle(max_steps=5_000)
    assert all(r.finish_reason == "length" for r in reqs), [
        (r.finish_reason, r.error) for r in reqs
    ]
    assert all(u.used == 0 for u in eng.mem.usage()), eng.mem.usage()
    eng.mem.check_integrity()
    return [r.output for r in reqs]


def expected(
    model: ModelConfig, prompts: Sequence[Sequence[int]], new: Sequence[int]
) -> list[list[int]]:
    return [
        oracle_greedy(model, WEIGHTS[model.name], p, n) for p, n in zip(prompts, new, strict=True)
    ]


@pytest.mark.parametrize("model", [tiny(), hybrid_tiny()], ids=lambda m: m.name)
def test_scheduled_batches_equal_the_oracle(model: ModelConfig) -> None:
    prompts = [prompt(n, i) for i, n in enumerate((5, 40, 17, 70, 33))]
    new = [9, 6, 12, 5, 8]
    assert run(engine(model), prompts, new) == expected(model, prompts, new)


def test_memory_pressure_retracts_and_resumes_with_the_same_tokens() -> None:
    model = tiny()
    prompts = [prompt(n, i) for i, n in enumerate((30, 28, 33, 26))]
    new = [40, 40, 40, 40]
    eng = engine(model, full_pages=13, swa_pages=16, slots=4, chunk=32)
    reqs = [
        eng.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, new, strict=True)
    ]
    eng.run_until_idle()
    assert sum(r.retractions for r in reqs) >= 1  # the pools forced at least one retraction
    assert [r.output for r in reqs] == expected(model, prompts, new)
    assert all(u.used == 0 for u in eng.mem.usage())


def test_swa_pressure_defers_chunks_and_still_matches() -> None:
    model = tiny()
    prompts = [prompt(n, i) for i, n in enumerate((60, 55, 64))]
    new = [6, 6, 6]
    # 4 SWA pages: one request's window plus a chunk at a time.
    eng = engine(model, full_pages=40, swa_pages=4, slots=3, chunk=32)
    assert run(eng, prompts, new) == expected(model, prompts, new)
    # Chunks really waited for SWA pages (and only for those).
    swa_waits = {why: n for why, n in eng.waits.items() if "SWA pages" in why}
    assert swa_waits and sum(swa_waits.values()) >= 1, eng.waits


def test_a_request_that_can_never_fit_is_rejected_at_once() -> None:
    eng = engine(tiny(), full_pages=4)
    too_long = eng.submit(prompt(60, 1), SamplingParams(max_new_tokens=10))  # 70 > 64 tokens
    fine = eng.submit(prompt(10, 2), SamplingParams(max_new_tokens=3))
    finished = eng.step()
    assert too_long in finished and too_long.finish_reason == "error"
    assert "exceeds the maximum context of 64 tokens" in (too_long.error or "")
    eng.run_until_idle()
    assert fine.finish_reason == "length" and len(fine.output) == 3


def test_abort_frees_the_pages_at_once() -> None:
    eng = engine(tiny())
    req = eng.submit(prompt(40, 3), SamplingParams(max_new_tokens=50))
    for _ in range(4):
        eng.step()
    assert eng.mem.usage()[0].used > 0
    eng.abort(req.rid)
    assert req.finish_reason == "abort" and all(u.used == 0 for u in eng.mem.usage())


def test_stop_token_ends_the_request() -> None:
    model = tiny()
    p = prompt(12, 4)
    greedy = expected(model, [p], [8])[0]
    eng = engine(model)
    req = eng.submit(p, SamplingParams(max_new_tokens=8, stop_token_ids=(greedy[3],)))
    eng.run_until_idle()
    assert req.finish_reason == "stop" and req.output == greedy[: greedy.index(greedy[3]) + 1]


def test_seeded_sampling_is_reproducible() -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=5)
    outs = []
    for _ in range(2):
        eng = engine(tiny())
        req = eng.submit(prompt(9, 5), params)
        eng.run_until_idle()
        outs.append(req.output)
    assert outs[0] == outs[1] and len(outs[0]) == 10


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 45), min_size=1, max_size=5),
    new=st.integers(1, 12),
    full_pages=st.integers(6, 20),
    chunk=st.integers(4, 40),
)
def test_no_admitted_request_starves_and_tokens_match(
    lengths: list[int], new: int, full_pages: int, chunk: int
) -> None:
    model = tiny()
    prompts = [prompt(n, i) for i, n in enumerate(lengths)]
    eng = engine(model, full_pages=full_pages, swa_pages=8, slots=3, chunk=chunk)
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    eng.run_until_idle(max_steps=3_000)  # raises if anything starves
    for req, p in zip(reqs, prompts, strict=True):
        if len(p) + new > full_pages * 16:
            assert req.finish_reason == "error"
        else:
            assert req.finish_reason == "length"
            assert req.output == oracle_greedy(model, WEIGHTS["tiny"], p, new)
    assert all(u.used == 0 for u in eng.mem.usage())
    assert torch.equal(eng.mem.pages.full_to_swa, torch.zeros_like(eng.mem.pages.full_to_swa))


def test_the_head_of_the_queue_is_not_overtaken_forever() -> None:
    """A big request waiting for pages is not starved by a stream of small ones behind it."""
    eng = engine(tiny(), full_pages=10, swa_pages=16, slots=4, chunk=16)
    first = eng.submit(prompt(50, 1), SamplingParams(max_new_tokens=30))  # holds 4-5 pages
    eng.step()
    big = eng.submit(prompt(110, 2), SamplingParams(max_new_tokens=4))  # needs 8 of 10 pages
    # It waits for `first` (about 30 steps), while small requests arrive every step.
    for step in range(100):
        eng.submit(prompt(5, 3 + step), SamplingParams(max_new_tokens=20))
        eng.step()
        if big.finished:
            break
    assert big.finish_reason == "length", f"still waiting after {step + 1} steps"
    assert first.finish_reason == "length"
    for rid in list(eng.requests):  # the small ones still running or waiting
        eng.abort(rid)
    assert eng.idle and all(u.used == 0 for u in eng.mem.usage())
