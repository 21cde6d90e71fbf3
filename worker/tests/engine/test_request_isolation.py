"""A request fails alone (issue #37 item 1): degenerate sampling parameters are served (a
temperature below the floor is greedy), and an exception in one request's sampling, processors,
grammar or token acceptance fails that request only, with its error code, while the others of
its batch finish with the tokens they get without it; a forward that raises fails its batch and
the engine serves the next one. Pages are back to zero after each (`check_integrity`).

Faults are injected into the real engine (tiny model, CPU) by replacing one function for the
requests a test marks (seed 13): the engine code around it is what runs in production."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import engine

from dsv4_common.core.presets import tiny
from dsv4_worker.engine import loop
from dsv4_worker.engine.failures import INTERNAL_CODE, SAMPLING_CODE
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.sampler import TEMPERATURE_FLOOR, SamplingParams
from dsv4_worker.model.weights import init_weights

BAD_SEED = 13  # the requests a test's fault hits
PROMPTS = (list(b"Hello"), list(b"Once upon"), list(b"The"))
NEW = 4  # tokens per request


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded 2-core machine torch's default (one per core) makes a
    tiny step many times slower (OpenMP workers wait for a core), not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return init_weights(tiny(), seed=1)


def fresh(weights: dict[str, torch.Tensor]) -> Engine:
    return engine(tiny(), weights)


def neighbours() -> list[SamplingParams]:
    """The requests batched with the faulty one: greedy, seeded, processed, with logprobs."""
    return [
        SamplingParams(max_new_tokens=NEW),
        SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=5, top_k=40),
        SamplingParams(max_new_tokens=NEW, logit_bias=((101, 3.0),), repetition_penalty=1.3),
        SamplingParams(max_new_tokens=NEW, logprobs=2),
    ]


@pytest.fixture(scope="module")
def expected(weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """The neighbours' tokens without the faulty request."""
    eng = fresh(weights)
    reqs = [eng.submit(PROMPTS[i % 3], p) for i, p in enumerate(neighbours())]
    eng.run_until_idle()
    return [r.output for r in reqs]


def assert_idle_and_whole(eng: Engine) -> None:
    eng.mem.check_integrity()
    assert all(u.used == 0 for u in eng.mem.usage()), eng.mem.usage()
    assert eng.failure is None


def run_with(eng: Engine, bad: SamplingParams) -> tuple[Request, list[Request]]:
    """The faulty request (submitted second, so it shares every step) and its neighbours."""
    others = [eng.submit(PROMPTS[i % 3], p) for i, p in enumerate(neighbours()[:1])]
    failing = eng.submit(PROMPTS[1], bad)
    others += [eng.submit(PROMPTS[i % 3], p) for i, p in enumerate(neighbours()) if i > 0]
    eng.run_until_idle()
    return failing, others


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, TEMPERATURE_FLOOR / 2])
def test_a_temperature_below_the_floor_samples_greedily(
    weights: dict[str, torch.Tensor], temperature: float
) -> None:
    """The issue's body: temperature 5e-324 killed the engine thread (division by it)."""
    eng = fresh(weights)
    cold = eng.submit(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=temperature))
    greedy = eng.submit(PROMPTS[0], SamplingParams(max_new_tokens=4))
    eng.run_until_idle()
    assert cold.finish_reason == "length" and cold.output == greedy.output
    assert cold.generator is None  # no generator is drawn from
    assert_idle_and_whole(eng)


def test_a_tiny_repetition_penalty_stays_finite(weights: dict[str, torch.Tensor]) -> None:
    """A denormal repetition penalty divides positive logits of seen tokens: they win, without
    an inf or a NaN reaching the draw (seeded sampling would raise on them)."""
    eng = fresh(weights)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, repetition_penalty=5e-324)
    req = eng.submit(PROMPTS[0], params)
    eng.run_until_idle()
    assert req.finish_reason == "length" and len(req.output) == 5
    assert_idle_and_whole(eng)


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`fault(name, wrapper)`: replace `loop.<name>` by wrapper(original)."""

    def install(name: str, wrap: Any) -> None:
        monkeypatch.setattr(loop, name, wrap(getattr(loop, name)))

    yield install


def raising_for_bad_seed(original: Any) -> Any:
    def draw(scores: torch.Tensor, params: SamplingParams, gen: Any) -> int:
        if params.seed == BAD_SEED:
            raise RuntimeError("injected: the sampler broke")
        return int(original(scores, params, gen))

    return draw


def test_a_request_whose_draw_raises_fails_alone(
    weights: dict[str, torch.Tensor], expected: list[list[int]], fault: Any
) -> None:
    fault("draw", raising_for_bad_seed)
    eng = fresh(weights)
    failing, others = run_with(
        eng, SamplingParams(max_new_tokens=NEW, temperature=1, seed=BAD_SEED)
    )
    assert failing.finish_reason == "error" and failing.error_code == INTERNAL_CODE
    assert failing.error is not None and "the sampler broke" in failing.error
    assert [r.output for r in others] == expected
    assert all(r.finish_reason == "length" for r in others)
    assert_idle_and_whole(eng)


def test_a_request_whose_processors_raise_fails_alone(
    weights: dict[str, torch.Tensor], expected: list[list[int]], fault: Any
) -> None:
    """The processors run batched: the batch raises, each request runs alone, the one at
    fault fails, the other processed one keeps its exact tokens."""

    def wrap(original: Any) -> Any:
        def apply(logits: torch.Tensor, batch: Any) -> torch.Tensor:
            if any(p.params.seed == BAD_SEED for p in batch):
                raise ValueError("injected: a processor broke")
            return original(logits, batch)  # type: ignore[no-any-return]

        return apply

    fault("apply_processors", wrap)
    eng = fresh(weights)
    bad = SamplingParams(max_new_tokens=NEW, seed=BAD_SEED, presence_penalty=0.5)
    failing, others = run_with(eng, bad)
    assert failing.finish_reason == "error" and failing.error_code == INTERNAL_CODE
    assert [r.output for r in others] == expected
    assert_idle_and_whole(eng)


class FakeMatcher:
    """A grammar matcher (`grammar.Matcher`) that allows `allowed` and raises as told."""

    def __init__(self, allowed: range, *, mask_raises: bool = False, accept_raises: bool = False):
        self.allowed = allowed
        self.mask_raises = mask_raises
        self.accept_raises = accept_raises

    mask_words = 16  # 512 tokens: the tiny model's vocabulary

    def fill_mask(self, words: np.ndarray) -> None:
        if self.mask_raises:
            raise RuntimeError("injected: the grammar broke")
        bits = np.zeros(self.mask_words * 32, dtype=np.uint8)
        bits[list(self.allowed)] = 1
        words[:] = np.packbits(bits, bitorder="little").view(np.int32)

    def accept(self, token: int) -> bool:
        if self.accept_raises:
            raise RuntimeError("injected: accepting broke")
        return token in self.allowed

    @property
    def done(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("matcher", "code", "words", "temperature"),
    [
        (FakeMatcher(range(512), mask_raises=True), INTERNAL_CODE, "the grammar broke", 0.0),
        (FakeMatcher(range(512), accept_raises=True), INTERNAL_CODE, "accepting broke", 1.0),
        (FakeMatcher(range(0)), SAMPLING_CODE, "no token is allowed", 0.0),
        (FakeMatcher(range(0)), SAMPLING_CODE, "no token is allowed", 1.0),
    ],
    ids=["mask raises", "accept raises", "nothing allowed greedy", "nothing allowed sampled"],
)
def test_a_request_whose_grammar_fails_fails_alone(
    weights: dict[str, torch.Tensor],
    expected: list[list[int]],
    matcher: FakeMatcher,
    code: str,
    words: str,
    temperature: float,
) -> None:
    """A matcher that raises (computing its mask or taking a token) or allows nothing fails
    its request; the others' masks are computed alone and their tokens are unchanged."""
    eng = fresh(weights)
    first = eng.submit(PROMPTS[0], neighbours()[0])
    failing = eng.submit(PROMPTS[1], SamplingParams(max_new_tokens=NEW, temperature=temperature))
    failing.matcher, failing.plain = matcher, False
    guided = eng.submit(PROMPTS[2], SamplingParams(max_new_tokens=NEW))  # every token allowed
    guided.matcher, guided.plain = FakeMatcher(range(512)), False
    others = [first, *(eng.submit(PROMPTS[i % 3], p) for i, p in enumerate(neighbours()) if i)]
    eng.run_until_idle()
    assert failing.finish_reason == "error" and failing.error_code == code, failing.error
    assert failing.error is not None and words in failing.error
    assert [r.output for r in others] == expected
    assert guided.finish_reason == "length" and len(guided.output) == NEW
    assert_idle_and_whole(eng)


def test_a_forward_that_raises_fails_its_batch_and_the_engine_serves_on(
    weights: dict[str, torch.Tensor],
    expected: list[list[int]],
) -> None:
    """A forward cannot be blamed on one request: every request of the batch fails (pages
    freed), the waiting ones are untouched, and the next batch runs as if nothing happened."""
    eng = fresh(weights)
    forward = eng.paged.forward
    calls = {"n": 0}

    def broken_once(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:  # mid-decode
            raise RuntimeError("injected: the device broke")
        return forward(*args, **kwargs)

    eng.paged.forward = broken_once  # type: ignore[method-assign]
    batch = [eng.submit(PROMPTS[i], SamplingParams(max_new_tokens=NEW)) for i in range(2)]
    while calls["n"] < 3:
        eng.step()
    assert all(r.finish_reason == "error" and r.error_code == INTERNAL_CODE for r in batch)
    assert_idle_and_whole(eng)
    after = [eng.submit(PROMPTS[i % 3], p) for i, p in enumerate(neighbours())]
    eng.run_until_idle()
    assert [r.output for r in after] == expected
    assert_idle_and_whole(eng)
