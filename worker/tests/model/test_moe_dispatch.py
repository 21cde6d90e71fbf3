"""The MoE's two dispatches (issue #38 item 5): `every_expert`, the fixed-shape one a device
takes (no read-back), gives what `by_expert`, the host's (a chosen expert over the rows that
chose it), gives: for top-k and hash layers, any k, batch size and compute dtype. The values
come from matmuls over different row counts, so they agree within a few ulps (a BLAS result
for a row may depend on how many rows it is computed with), never by contract to the bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import emulating_device
from model_helpers import tiny_moe, ulp_tolerance

from dsv4_common.core.model import DSV4Config
from dsv4_worker.mem.sync_counter import SyncCounter
from dsv4_worker.model.moe import by_expert, every_expert, moe, route
from dsv4_worker.model.params import Params
from dsv4_worker.model.weights import init_weights

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _inputs(
    model: DSV4Config, seed: int, tokens: int, dtype: torch.dtype
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    p = Params.of(init_weights(model, seed=seed), dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, model.weights.hidden_size, generator=gen).to(dtype)
    ids = torch.randint(0, model.weights.vocab_size, (tokens,), generator=gen)
    return p, x, ids


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 4),
    tokens=st.integers(1, 48),
    layer=st.sampled_from([0, 1, 3]),  # layer 0 routes by hash (num_hash_layers 1), the rest top-k
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_every_expert_equals_by_expert(
    k: int, tokens: int, layer: int, dtype: str, seed: int
) -> None:
    model = tiny_moe(k)
    p, x, ids = _inputs(model, seed, tokens, DTYPES[dtype])
    chosen, weights = route(model, p, layer, x, ids)
    want = by_expert(model, p, layer, x, chosen, weights)
    got = every_expert(model, p, layer, x, chosen, weights)
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
    assert float(want.abs().max()) > 0  # the experts contribute
    tol = ulp_tolerance(want.float(), 64) if dtype != "bfloat16" else 0.0
    if dtype == "bfloat16":  # both round each expert's output to bfloat16: a few of its ulps
        tol = 8 * torch.finfo(torch.bfloat16).eps * max(float(want.float().abs().max()), 1.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


def test_a_token_that_lists_an_expert_twice_gets_both_weights() -> None:
    """A hash table may name one expert twice for a token: both dispatches add it twice."""
    model = tiny_moe(3)
    p, x, _ = _inputs(model, 5, 6, torch.float64)
    chosen = torch.tensor([[0, 0, 1], [2, 3, 3], [1, 2, 3], [0, 0, 0], [3, 1, 3], [2, 0, 1]])
    weights = torch.rand(6, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = by_expert(model, p, 1, x, chosen, weights)
    got = every_expert(model, p, 1, x, chosen, weights)
    torch.testing.assert_close(got, want, rtol=0, atol=ulp_tolerance(want))


def test_an_expert_no_token_chose_adds_nothing() -> None:
    """An expert no token chose leaves `every_expert`'s output as `by_expert`'s even when its
    own output is not finite (NaN weights here): its rows are dropped, not multiplied by 0."""
    model = tiny_moe(1)
    p, x, _ = _inputs(model, 7, 5, torch.float64)
    chosen = torch.tensor([[0], [2], [0], [3], [2]])  # expert 1 unused
    weights = torch.full((5, 1), 0.75, dtype=torch.float64)
    held = {n: p.held(n) for n in p.names()}
    for n in ("w1", "w3", "w2"):
        name = f"layers.1.ffn.experts.1.{n}.weight"
        held[name] = torch.full_like(held[name], float("nan"))  # NaN x 0 would be NaN
    poisoned = Params.of(held, torch.float64)
    want = by_expert(model, p, 1, x, chosen, weights)
    got = every_expert(model, poisoned, 1, x, chosen, weights)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=0, atol=ulp_tolerance(want))


@pytest.mark.parametrize("layer", [0, 2], ids=["hash", "top-k"])
def test_moe_reads_nothing_back_on_a_device(layer: int) -> None:
    """Under DSV4_EMULATE_DEVICE=1 (the code CUDA runs) `moe` makes no device sync and gives
    what it gives on the host path."""
    model = dataclasses.replace(tiny_moe(2), name="tiny-moe")
    p, x, ids = _inputs(model, 11, 24, torch.float32)
    host = moe(model, p, layer, x, ids)
    with emulating_device(), SyncCounter() as counter:
        device = moe(model, p, layer, x, ids)
    assert dict(counter.counts) == {}
    torch.testing.assert_close(device, host, rtol=0, atol=ulp_tolerance(host))
