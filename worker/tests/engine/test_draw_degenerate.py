"""The draw on degenerate scores (issue #37 item 1), on CPU and, where one is lent, on CUDA
(where sampling NaN probabilities is a device-side assert that poisons the process): a row
with no finite score, a NaN or a +inf raises NoTokenAllowed and samples nothing; a temperature
below the floor is the argmax; large scores at the smallest sampled temperature still draw the
best token; the device keeps working afterwards."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_worker.engine.sampler import (
    TEMPERATURE_FLOOR,
    NoTokenAllowed,
    SamplingParams,
    draw,
    make_generator,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]
SAMPLED = SamplingParams(temperature=1.0, seed=7, top_k=3, top_p=0.9, min_p=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("values", "why"),
    [
        ([-math.inf] * 4, "no token is allowed"),
        ([0.0, math.nan, 1.0, 2.0], "nan"),
        ([0.0, math.inf, 1.0, 2.0], "inf"),
    ],
    ids=["all -inf", "a NaN", "a +inf"],
)
@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_row_without_a_token_to_pick_is_refused(
    device: str, values: list[float], why: str, params: SamplingParams
) -> None:
    dev = torch.device(device)
    gen = make_generator(params, dev)
    with pytest.raises(NoTokenAllowed, match=why):
        draw(torch.tensor(values, device=dev), params, gen)
    # The device still samples (no device-side assert happened).
    assert draw(torch.tensor([0.0, 9.0, 1.0], device=dev), params, gen) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_temperatures_and_huge_scores_stay_exact(device: str) -> None:
    dev = torch.device(device)
    scores = torch.tensor([3.0e38, -3.0e38, 2.9e38, 0.0], device=dev, dtype=torch.float64)
    for temperature in (5e-324, TEMPERATURE_FLOOR / 2):
        cold = SamplingParams(temperature=temperature, seed=1)
        assert make_generator(cold, dev) is None  # below the floor: greedy
        assert draw(scores, cold, None) == 0
    coldest = SamplingParams(temperature=TEMPERATURE_FLOOR, seed=1)
    gen = make_generator(coldest, dev)
    assert gen is not None
    # (scores - max) / T: the gap to the best is ~1e43, never +inf: the best always wins.
    assert all(draw(scores, coldest, gen) == 0 for _ in range(20))
