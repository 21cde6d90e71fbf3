"""The logit processors batched over a step's requests (`penalties.apply_processors`) equal the
per-request reference (`sampler.adjust`) bit for bit, over hypothesis-drawn batches whose
requests mix every processor, grow their outputs step by step (the token counts are kept
incrementally) and come and go; the logits themselves are never modified. In the engine,
sampling with processors gives the tokens the reference gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import engine as make_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Adjusted, Engine, SampleAt
from dsv4_worker.engine.penalties import Processed, TokenCounts, apply_processors, penalized
from dsv4_worker.engine.sampler import SamplingParams, adjust
from dsv4_worker.model.weights import init_weights

VOCAB = 16
MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=5)
TOKEN = st.integers(0, VOCAB - 1)


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    max_new = draw(st.integers(1, 12))
    bias = draw(st.dictionaries(st.integers(0, VOCAB + 3), st.floats(-100, 100), max_size=4))
    return SamplingParams(
        max_new_tokens=max_new,
        min_tokens=draw(st.integers(0, max_new)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB + 3), max_size=3))),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, -2.0, 0.5, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, -1.5, 0.25, 2.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0])),
        logit_bias=tuple(bias.items()),  # unique token ids, as the API's JSON object gives
    )


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[tuple[SamplingParams, list[int]]], list[list[int]]]:
    """Requests (params, prompt) and, per step, which of them sample (a request may skip a
    step, as a chunked or retracted one does; once it ends it is gone)."""
    requests = draw(
        st.lists(
            st.tuples(params(), st.lists(TOKEN, min_size=1, max_size=8)), min_size=1, max_size=6
        )
    )
    schedule = draw(
        st.lists(st.lists(st.integers(0, len(requests) - 1), unique=True), min_size=1, max_size=5)
    )
    return requests, schedule


LOGIT = st.floats(-30, 30, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(steps(), st.data())
def test_batched_processors_equal_the_per_request_reference(
    drawn: tuple[list[tuple[SamplingParams, list[int]]], list[list[int]]], data: st.DataObject
) -> None:
    requests, schedule = drawn
    outputs: list[list[int]] = [[] for _ in requests]
    counts: list[TokenCounts | None] = [None] * len(requests)
    cpu = torch.device("cpu")
    for active in schedule:
        rows = len(active) + data.draw(st.integers(0, 2))  # rows of requests without processors
        flat = data.draw(st.lists(LOGIT, min_size=rows * VOCAB, max_size=rows * VOCAB))
        logits = torch.tensor(flat, dtype=torch.float32).reshape(rows, VOCAB)
        before = logits.clone()
        order = data.draw(st.permutations(range(rows)))  # requests sit at any rows
        batch = []
        for slot, r in zip(order, active, strict=False):
            p, prompt = requests[r]
            if counts[r] is None and penalized(p):
                counts[r] = TokenCounts.new(p, prompt, cpu)
            batch.append(Processed(slot, p, outputs[r], counts[r]))
        if not batch:
            continue
        got = apply_processors(logits, batch)
        assert torch.equal(logits, before), "the logits are read, never written"
        for k, (slot, r) in enumerate(zip(order, active, strict=False)):
            p, prompt = requests[r]
            want = adjust(logits[slot], p, prompt, outputs[r])
            assert got.dtype == want.dtype == torch.float64
            # Bit equality is right: every processor is elementwise on a row (no reduction, no
            # matmul), so a value's operations do not depend on the batch it sits in.
            assert torch.equal(got[k], want), (k, p, outputs[r], got[k], want)
        for r in active:  # each sampled one more token
            outputs[r].append(data.draw(TOKEN))


def _reference_processed(
    self: Engine, logits: torch.Tensor, sample_at: SampleAt, failed: object = None
) -> Adjusted:
    """The engine's step before batching: `adjust` per request from its token lists, and
    every token drawn from its own row (greedy too); nothing fails here (`failed` unused)."""
    at = [j for j, (_, req) in enumerate(sample_at) if not req.plain and req.params.processed]
    if not at:
        return Adjusted(torch.empty(0), {}, {})
    rows = [
        adjust(logits[sample_at[j][0]], r.params, r.prompt, r.output)
        for j in at
        for r in [sample_at[j][1]]
    ]
    return Adjusted(torch.stack(rows), {j: k for k, j in enumerate(at)}, {})


def _run(drawn: list[SamplingParams], seed: int) -> list[list[int]]:
    engine = make_engine(MODEL, WEIGHTS, chunk=8)  # prompts arrive over several chunks
    requests = []
    for i, p in enumerate(drawn):
        changes = {"temperature": 0.0 if i % 2 else 0.8, "seed": seed + i}
        prompt = [((7 * j + 13 * i) % 250) + 3 for j in range(5 + 4 * i)]
        requests.append(engine.submit(prompt, dataclasses.replace(p, **changes)))
    requests.append(engine.submit([5, 6, 7], SamplingParams(max_new_tokens=6)))  # plain
    engine.run_until_idle()
    return [r.output for r in requests]


@settings(max_examples=10, deadline=None)
@given(st.lists(params(), min_size=1, max_size=4), st.integers(0, 2**31))
def test_the_engine_samples_what_the_per_request_path_samples(
    drawn: list[SamplingParams], seed: int
) -> None:
    """Requests with every mix of processors, batched with a plain one, give the same tokens
    through the batched step as through the per-request one (seeded, greedy and sampled)."""
    batched = _run(drawn, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "_processed", _reference_processed)
        per_request = _run(drawn, seed)
    assert batched == per_request
