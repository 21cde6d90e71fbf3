"""Fuzz the sampler and the logit processors through a real engine (tiny, CPU, a grammar
compiler over the byte tokenizer; issue #37 item 1): batches of requests whose every sampling
field ranges over all the values the API accepts (`server/generation.py`'s ranges), with the
bounds, 0 and denormals drawn on purpose. Invariants: the engine never fails, every request
ends with "stop" or "length" (no error: none of these values is a reason to fail), its tokens
are in the vocabulary, its logprobs are finite or -inf, and the pools are back to zero with
`check_integrity` after every batch."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import engine
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.grammar import JSON_OBJECT, GrammarCompiler
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import REPETITION_FLOOR, TEMPERATURE_FLOOR, SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.server.tokenizer import ByteTokenizer

VOCAB = tiny().weights.vocab_size
TINY = sys.float_info.min * sys.float_info.epsilon  # 5e-324, the smallest denormal
SCHEMAS = (
    None,
    JSON_OBJECT,
    '{"properties":{"a":{"type":"integer"}},"required":["a"],"type":"object"}',
    '{"enum":["x","yz"]}',
)


def bounded(low: float, high: float, specials: tuple[float, ...] = ()) -> st.SearchStrategy[float]:
    """Floats of [low, high], denormals included, with the bounds and `specials` often."""
    edges = [v for v in (low, high, 0.0, TINY, -TINY, *specials) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.floats(low, high, allow_subnormal=True))


def open_low(high: float, specials: tuple[float, ...] = ()) -> st.SearchStrategy[float]:
    """Floats of (0, high]."""
    return bounded(0.0, high, specials).filter(lambda v: v > 0)


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    new = draw(st.integers(1, 3))
    stops = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3, unique=True))
    bias = draw(st.lists(st.tuples(st.integers(0, VOCAB - 1), bounded(-100.0, 100.0)), max_size=4))
    k_top = st.one_of(st.integers(0, VOCAB + 1), st.sampled_from([1, 2**63, 10**30]))
    return SamplingParams(
        max_new_tokens=new,
        temperature=draw(bounded(0.0, 100.0, (TEMPERATURE_FLOOR, TEMPERATURE_FLOOR / 2))),
        top_p=draw(open_low(1.0)),
        top_k=draw(k_top),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        stop_token_ids=tuple(stops),
        min_p=draw(bounded(0.0, 1.0)),
        min_tokens=draw(st.integers(0, new)),
        presence_penalty=draw(bounded(-2.0, 2.0)),
        frequency_penalty=draw(bounded(-2.0, 2.0)),
        repetition_penalty=draw(open_low(2.0, (REPETITION_FLOOR, REPETITION_FLOOR / 10))),
        logit_bias=tuple(sorted(bias)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        prompt_logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        json_schema=draw(st.sampled_from(SCHEMAS)),
    )


PROMPT = st.lists(st.integers(0, 255), min_size=1, max_size=6)
BATCH = st.lists(st.tuples(PROMPT, params()), min_size=1, max_size=4)
EXTREMES = [
    SamplingParams(max_new_tokens=2, temperature=TINY),
    SamplingParams(max_new_tokens=2, temperature=100.0, top_p=TINY, top_k=1, min_p=1.0),
    SamplingParams(max_new_tokens=2, temperature=1.0, min_p=TINY, repetition_penalty=TINY),
    SamplingParams(
        max_new_tokens=3,
        temperature=TEMPERATURE_FLOOR,
        min_tokens=3,
        stop_token_ids=tuple(range(VOCAB - 3, VOCAB)),
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logit_bias=((0, -100.0), (1, 100.0), (2, TINY)),
        logprobs=20,
        prompt_logprobs=0,
        json_schema=JSON_OBJECT,
    ),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded 2-core machine torch's default (one per core) makes a
    tiny step many times slower (OpenMP workers wait for a core), not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shared() -> Engine:
    eng = engine(tiny(), init_weights(tiny(), seed=1))
    eng.grammar = GrammarCompiler(ByteTokenizer(), VOCAB)
    return eng


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same batches every run (the extremes above are always in)
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=BATCH)
@example(batch=[(list(b"Hi"), p) for p in EXTREMES])
@example(  # unsatisfiable: after `{"` the grammar allows only 'a', a stop min_tokens bans
    batch=[
        (
            [0],
            SamplingParams(
                max_new_tokens=3, min_tokens=3, stop_token_ids=(97,), json_schema=SCHEMAS[2]
            ),
        ),
        (list(b"Hi"), SamplingParams(max_new_tokens=2)),
    ]
)
def test_every_accepted_sampling_value_is_served_and_the_engine_lives(
    shared: Engine, batch: list[tuple[list[int], SamplingParams]]
) -> None:
    reqs = [shared.submit(prompt, p) for prompt, p in batch]
    shared.run_until_idle(max_steps=200)
    assert shared.failure is None
    for req in reqs:
        if req.finish_reason == "error":
            # Constraints that together allow no token fail that request alone (the engine
            # lives, asserted above): a grammar whose only next token is a stop token that
            # min_tokens still bans, or one a -100 logit bias removed (found: {"a": ...} with
            # stop 'a' and min_tokens 3).
            assert req.params.json_schema is not None, (req.params, req.error)
            assert req.error is not None and "no token is allowed here" in req.error
            continue
        assert req.finish_reason in ("stop", "length"), (req.params, req.error)
        assert all(0 <= t < VOCAB for t in req.output)
        entries = [*req.logprobs, *req.prompt_logprobs]
        values = [e.logprob for e in entries] + [v for e in entries for _, v in e.top]
        assert all(not math.isnan(v) and v <= 0 for v in values)
    shared.mem.check_integrity()
    assert all(u.used == 0 for u in shared.mem.usage())
