"""The sampler's logit processors as specified (vLLM semantics), checked on random logits:
a huge negative logit_bias never picks its token and a huge positive one always does, stop
ids are never sampled before min_tokens, the penalties equal their formulas written out per
token, the processors leave greedy and seeded sampling untouched when off, and logprobs are
the log-softmax of the raw logits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.engine.logprobs import row_layout, token_logprobs
from dsv4_worker.engine.sampler import SamplingParams, adjust, make_generator, sample

VOCAB = 12
LOGITS = st.lists(
    st.floats(-20, 20, allow_nan=False, width=32), min_size=VOCAB, max_size=VOCAB
).map(lambda v: torch.tensor(v, dtype=torch.float32))
TOKENS = st.lists(st.integers(0, VOCAB - 1), max_size=12)
TEMPERATURE = st.sampled_from([0.0, 0.5, 1.0, 2.0])
SEED = st.integers(0, 2**31)


def draw(logits: torch.Tensor, params: SamplingParams, output: list[int] | None = None) -> int:
    gen = make_generator(params, torch.device("cpu"))
    return sample(logits, params, gen, prompt=[1, 2], output=output or [])


@settings(max_examples=150, deadline=None)
@given(LOGITS, st.integers(0, VOCAB - 1), TEMPERATURE, SEED)
def test_a_huge_negative_bias_never_picks_the_token(
    logits: torch.Tensor, token: int, temperature: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, seed=seed, logit_bias=((token, -100.0),))
    assert draw(logits, params) != token


@settings(max_examples=150, deadline=None)
@given(LOGITS, st.integers(0, VOCAB - 1), TEMPERATURE, SEED)
def test_a_huge_positive_bias_always_picks_the_token(
    logits: torch.Tensor, token: int, temperature: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, seed=seed, logit_bias=((token, 100.0),))
    assert draw(logits, params) == token


@settings(max_examples=200, deadline=None)
@given(
    LOGITS,
    st.sets(st.integers(0, VOCAB - 2), min_size=1, max_size=VOCAB - 1),
    st.integers(1, 8),
    st.integers(0, 10),
    TEMPERATURE,
    SEED,
)
def test_stop_ids_are_never_sampled_before_min_tokens(
    logits: torch.Tensor,
    stops: set[int],
    min_tokens: int,
    out_len: int,
    temperature: float,
    seed: int,
) -> None:
    # The stop ids are the most likely tokens by far: only min_tokens keeps them out.
    logits = logits.clone()
    logits[list(stops)] = 50.0
    params = SamplingParams(
        max_new_tokens=16,
        temperature=temperature,
        seed=seed,
        stop_token_ids=tuple(sorted(stops)),
        min_tokens=min_tokens,
    )
    token = draw(logits, params, output=[VOCAB - 1] * out_len)
    if out_len < min_tokens:
        assert token not in stops
    elif temperature == 0:
        assert token in stops  # from min_tokens on they are allowed again


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """vLLM's rule written out token by token."""
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        count = output.count(t)
        x -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        out.append(x)
    return out


@settings(max_examples=200, deadline=None)
@given(
    LOGITS,
    TOKENS,
    TOKENS,
    st.floats(-2, 2),
    st.floats(-2, 2),
    st.floats(0.05, 2),
)
def test_penalties_equal_their_formulas(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> None:
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition
    )
    got = adjust(logits, params, prompt, output).tolist()
    want = reference_penalties(logits.double().tolist(), prompt, output, params)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(LOGITS, TOKENS, TEMPERATURE, SEED)
def test_processors_off_leave_sampling_as_it_was(
    logits: torch.Tensor, output: list[int], temperature: float, seed: int
) -> None:
    """Defaults (and zero penalties) give the tokens of the plain sampler."""
    plain = SamplingParams(temperature=temperature, seed=seed)
    zeros = SamplingParams(
        temperature=temperature,
        seed=seed,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        min_tokens=0,
    )
    assert not zeros.processed
    assert torch.equal(adjust(logits, zeros, [1], output), logits.double())
    assert draw(logits, plain, output) == draw(logits, zeros, output)
    if temperature == 0:
        assert draw(logits, plain, output) == int(logits.argmax())


@settings(max_examples=100, deadline=None)
@given(st.lists(LOGITS, min_size=1, max_size=4), st.integers(0, 5), st.data())
def test_logprobs_are_the_log_softmax_of_the_raw_logits(
    rows: list[torch.Tensor], k: int, data: st.DataObject
) -> None:
    logits = torch.stack(rows)
    tokens = [data.draw(st.integers(0, VOCAB - 1)) for _ in rows]
    entries = token_logprobs(logits, tokens, k)
    for row, token, entry in zip(rows, tokens, entries, strict=True):
        ref = torch.log_softmax(row.double(), -1)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(ref[token]), abs=1e-5)
        assert len(entry.top) == k
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        for t, v in entry.top:
            assert v == pytest.approx(float(ref[t]), abs=1e-5)
        if k:
            assert entry.top[0][1] == pytest.approx(float(ref.max()), abs=1e-5)
        assert math.fsum(math.exp(x) for x in ref.tolist()) == pytest.approx(1.0)


def test_row_layout_gives_every_row_of_scored_segments() -> None:
    assert row_layout([3, 1, 4], [False, False, True]) == [(0, 0), (1, 1), (2, 5)]
    assert row_layout([3, 2], [True, True]) == [(0, 2), (3, 4)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("min_tokens", 17),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_out_of_range_parameters_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
