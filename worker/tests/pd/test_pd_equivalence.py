"""Disaggregated == colocated, token for token, on both transfer backends (nixl also with
every write cut into shares by its poster threads): prompts shorter and longer than the window
and than several compression blocks, chunked prefill, many requests at once, seeded sampling,
the hybrid family, fp8 KV rows (the release's 584-byte pages move as opaque bytes); a prefill
SWA pool smaller than one prompt; a decode SWA pool that only
window tails fit. Every pool on both sides is back to zero afterwards."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest
from engine_helpers import engine
from hf_support import hf_reference, hf_tokens
from pd_support import pd_pair, wait_drained
from release_support import fp8_kv

from dsv4_common.core.model import ModelConfig
from dsv4_common.core.presets import hybrid_tiny, tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd.transfer import nixl_backend

BACKENDS = ["zmq", "nixl"]
TINY_FP8 = fp8_kv(dataclasses.replace(tiny(), name="tiny-fp8"))
WEIGHTS = {m.name: init_weights(m, seed=33) for m in (tiny(), hybrid_tiny(), TINY_FP8)}


def prompt(n: int, salt: int) -> list[int]:
    return [((29 * i + 11 * salt) % 250) + 3 for i in range(n)]


def colocated(
    model: ModelConfig, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> list[list[int]]:
    eng = engine(model, WEIGHTS[model.name])
    reqs = [eng.submit(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
    eng.run_until_idle(max_steps=5_000)
    assert all(u.used == 0 for u in eng.mem.usage())
    return [r.output for r in reqs]


def _check(pair_outputs, want: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    got = [tokens for tokens, _ in pair_outputs]
    reasons = [(done.reason, done.error) for _, done in pair_outputs]
    assert all(r in ("length", "stop") for r, _ in reasons), reasons
    assert got == want


@pytest.mark.parametrize("backend", [*BACKENDS, "nixl-shares"])
@pytest.mark.parametrize("model", [tiny(), hybrid_tiny(), TINY_FP8], ids=lambda m: m.name)
def test_greedy_disaggregated_equals_colocated(
    backend: str, model: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "nixl-shares":  # every write in byte shares from nixl's poster threads
        monkeypatch.setattr(nixl_backend, "PARALLEL_MIN_BYTES", 1)
        backend = "nixl"
    # lengths: < window, == a page, several c16 blocks, several pages, not page aligned
    prompts = [prompt(n, i) for i, n in enumerate((3, 16, 40, 70, 97, 33, 5, 64))]
    params = [SamplingParams(max_new_tokens=n) for n in (6, 9, 12, 5, 8, 20, 1, 7)]
    want = colocated(model, prompts, params)
    if model.name == "tiny":  # and transformers', an implementation no one here wrote
        reference = _reference()
        pairs = zip(prompts, params, strict=True)
        assert want == [hf_tokens(reference, p, sp.max_new_tokens) for p, sp in pairs]

    def make() -> Engine:
        return engine(model, WEIGHTS[model.name])

    with pd_pair(backend, make, make) as pair:
        _check(pair.generate(prompts, params), want)
        wait_drained(pair)


@cache
def _reference() -> Any:
    pytest.importorskip("transformers")
    return hf_reference(tiny(), WEIGHTS["tiny"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_disaggregated_equals_colocated(backend: str) -> None:
    model = tiny()
    prompts = [prompt(n, i + 3) for i, n in enumerate((12, 50, 30))]
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=s) for s in (1, 2, 3)
    ]
    want = colocated(model, prompts, params)

    def make() -> Engine:
        return engine(model, WEIGHTS[model.name])

    with pd_pair(backend, make, make) as pair:
        _check(pair.generate(prompts, params), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_swa_pools_on_both_sides(backend: str) -> None:
    """Prefill's SWA pool (4 pages = 64 tokens) is smaller than every prompt (its chunks shrink;
    it admits by the full pool); decode's (6 pages) holds only window tails, not prompts."""
    model = tiny()
    prompts = [prompt(n, i) for i, n in enumerate((150, 200, 120, 180))]
    params = [SamplingParams(max_new_tokens=6) for _ in prompts]
    want = colocated(model, prompts, params)
    with pd_pair(
        backend,
        lambda: engine(model, WEIGHTS[model.name], swa_pages=4, chunk=48),
        lambda: engine(model, WEIGHTS[model.name], swa_pages=6),
    ) as pair:
        _check(pair.generate(prompts, params), want)
        wait_drained(pair)
