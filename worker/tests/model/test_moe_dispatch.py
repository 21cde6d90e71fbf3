"""The MoE's dispatches (issue #38 items 5 and 7): the device's (`on_device`: `by_slot` for
decode-sized batches, `grouped` beyond, `every_expert` where neither runs), which read nothing
back, give what `by_expert`, the host's (a chosen expert over the rows that chose it), gives:
for top-k and hash layers, any k, batch size, compute dtype, stored expert format (floats, FP8
blocks, packed FP4) and chunking of the dequantized experts. The values come from matmuls over
different row counts, so they agree within a few ulps (a BLAS result for a row may depend on
how many rows it is computed with), never by contract to the bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mem_helpers import emulating_device
from model_helpers import tiny_moe, ulp_tolerance

from dsv4_common.core.model import DSV4Config
from dsv4_common.plan.inputs import PlanInputs
from dsv4_worker.mem.sync_counter import SyncCounter
from dsv4_worker.model.checkpoint import placed
from dsv4_worker.model.moe import by_expert, every_expert, expert_names, moe, on_device, route
from dsv4_worker.model.params import Params
from dsv4_worker.model.quant import quantize_fp4, quantize_fp8_block
from dsv4_worker.model.stored import FP4Packed, FP8Block, Stored
from dsv4_worker.model.weights import init_weights, stage_weights
from dsv4_worker.pp.group import build_stage

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _stored(name: str, w: torch.Tensor, experts: str) -> Stored:
    """`w` as a release stores it when `name` is a routed expert's and `experts` says so."""
    if ".experts." not in name or experts == "float":
        return w
    if experts == "fp4":
        return FP4Packed(*quantize_fp4(w.double()), w.shape[1])
    return FP8Block(*quantize_fp8_block(w.double(), (16, 16)), (16, 16))


def _inputs(
    model: DSV4Config, seed: int, tokens: int, dtype: torch.dtype, experts: str = "float"
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    held = {n: _stored(n, w, experts) for n, w in init_weights(model, seed=seed).items()}
    p = Params(held, dtype)
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


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4),
    tokens=st.integers(1, 24),  # k * tokens <= 4 experts: by_slot; beyond: grouped
    layer=st.sampled_from([0, 1]),
    dtype=st.sampled_from(sorted(DTYPES)),  # float64 beyond 4 pairs: every_expert
    experts=st.sampled_from(["float", "fp8", "fp4"]),
    # chunks of 1 expert, of 3 in float32 (6 in bfloat16, 1 in float64), of all 4
    scratch_bytes=st.sampled_from([1, 3 * 32 * 64 * 4, 1 << 30]),
    seed=st.integers(0, 2**16),
)
def test_the_device_dispatch_equals_by_expert(
    k: int, tokens: int, layer: int, dtype: str, experts: str, scratch_bytes: int, seed: int
) -> None:
    model = tiny_moe(k)
    p, x, ids = _inputs(model, seed, tokens, DTYPES[dtype], experts)
    chosen, weights = route(model, p, layer, x, ids)
    want = by_expert(model, p, layer, x, chosen, weights)
    got = on_device(model, p, layer, x, chosen, weights, scratch_bytes)
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
    tol = ulp_tolerance(want.float(), 64) if dtype != "bfloat16" else 0.0
    if dtype == "bfloat16":  # both round each expert's output to bfloat16: a few of its ulps
        tol = 8 * torch.finfo(torch.bfloat16).eps * max(float(want.float().abs().max()), 1.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


def _on_device_in_chunks_of_one(
    m: DSV4Config, p: Params, layer: int, x: torch.Tensor, c: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    return on_device(m, p, layer, x, c, w, scratch_bytes=1)


DISPATCHES = {
    "every_expert": every_expert,
    "on_device": on_device,
    "on_device-chunks-of-1": _on_device_in_chunks_of_one,
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("dispatch", sorted(DISPATCHES))
def test_a_token_that_lists_an_expert_twice_gets_both_weights(
    dispatch: str, dtype: torch.dtype
) -> None:
    """A hash table may name one expert twice for a token: every dispatch adds it twice (one
    token: 3 pairs, by_slot; six: 18 pairs, grouped in float32, every_expert in float64)."""
    model = tiny_moe(3)
    p, x, _ = _inputs(model, 5, 6, dtype)
    chosen = torch.tensor([[0, 0, 1], [2, 3, 3], [1, 2, 3], [0, 0, 0], [3, 1, 3], [2, 0, 1]])
    weights = torch.rand(6, 3, generator=torch.Generator().manual_seed(1), dtype=dtype)
    for rows in (slice(0, 1), slice(3, 4), slice(0, 6)):
        args = (x[rows], chosen[rows], weights[rows])
        want = by_expert(model, p, 1, *args)
        got = DISPATCHES[dispatch](model, p, 1, *args)
        torch.testing.assert_close(got, want, rtol=0, atol=ulp_tolerance(want))


@pytest.mark.parametrize("dispatch", sorted(DISPATCHES))
def test_an_expert_no_token_chose_adds_nothing(dispatch: str) -> None:
    """An expert no token chose leaves the output as `by_expert`'s even when its own output
    is not finite (NaN weights here): its rows are dropped, never multiplied by 0."""
    model = tiny_moe(1)
    p, x, _ = _inputs(model, 7, 5, torch.float32)
    chosen = torch.tensor([[0], [2], [0], [3], [2]])  # expert 1 unused
    weights = torch.full((5, 1), 0.75)
    held = {n: p.held(n) for n in p.names()}
    for n in ("w1", "w3", "w2"):
        name = f"layers.1.ffn.experts.1.{n}.weight"
        held[name] = torch.full_like(held[name], float("nan"))  # NaN x 0 would be NaN
    poisoned = Params.of(held, torch.float32)
    for rows in (slice(0, 4), slice(0, 5)):  # 4 pairs: by_slot; 5: grouped
        want = by_expert(model, p, 1, x[rows], chosen[rows], weights[rows])
        got = DISPATCHES[dispatch](model, poisoned, 1, x[rows], chosen[rows], weights[rows])
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, rtol=0, atol=ulp_tolerance(want))


@pytest.mark.parametrize("experts", ["float", "fp8", "fp4"])
@pytest.mark.parametrize("tokens", [1, 24], ids=["by-slot", "grouped"])
@pytest.mark.parametrize("layer", [0, 2], ids=["hash", "top-k"])
def test_moe_reads_nothing_back_on_a_device(layer: int, tokens: int, experts: str) -> None:
    """Under DSV4_EMULATE_DEVICE=1 (the code CUDA runs) `moe` makes no device sync and gives
    what it gives on the host path."""
    model = dataclasses.replace(tiny_moe(2), name="tiny-moe")
    p, x, ids = _inputs(model, 11, tokens, torch.float32, experts)
    host = moe(model, p, layer, x, ids)
    with emulating_device(), SyncCounter() as counter:
        device = moe(model, p, layer, x, ids)
    assert dict(counter.counts) == {}
    torch.testing.assert_close(device, host, rtol=0, atol=ulp_tolerance(host))


@pytest.mark.parametrize("emulate", [True, False], ids=["device", "host"])
def test_a_stage_built_for_a_device_holds_its_experts_stacked_in_the_same_bytes(
    emulate: bool,
) -> None:
    """`build_stage` stacks every MoE layer's experts before the KV pools where the device
    path reads them (the per-expert entries become views: the bytes held do not change), and
    leaves them as loaded on a host that reads the choice."""
    model = dataclasses.replace(tiny_moe(2), name="tiny-moe")
    inputs = PlanInputs(model=model, role="colocated", gpu_memory_bytes=1 << 30)
    full = init_weights(model, seed=3)
    with emulating_device(emulate):
        built = build_stage(inputs, lambda names: stage_weights(full, names), torch.device("cpu"))
    p = built.paged.p
    assert p.nbytes == sum(full[n].nbytes for n in p.names())
    for layer in range(model.num_hidden_layers):
        for names in expert_names(model, layer):
            held = p.held(names[0])
            assert isinstance(held, torch.Tensor)
            stacked = held.untyped_storage().nbytes() == len(names) * held.nbytes
            assert stacked == emulate, names[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 24], ids=["by-slot", "grouped"])
def test_on_cuda_the_device_dispatch_equals_by_expert_without_a_sync(tokens: int) -> None:
    """On CUDA in bfloat16 with FP4 experts (grouped: `F.grouped_mm`'s CUDA kernel) the device
    dispatch gives `by_expert`'s sum, and CUDA's own sync check finds no sync in it."""
    model = tiny_moe(2)
    host, x, ids = _inputs(model, 13, tokens, torch.float32, "fp4")
    dev = torch.device("cuda")
    p = Params({n: placed(host.held(n), None, dev) for n in host.names()}, torch.bfloat16)
    xd = x.to(dev, torch.bfloat16)
    chosen, weights = route(model, p, 1, xd, ids.to(dev))
    want = by_expert(model, p, 1, xd, chosen, weights)
    on_device(model, p, 1, xd, chosen, weights)  # stacks the experts (a one-time copy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = on_device(model, p, 1, xd, chosen, weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tol = 8 * torch.finfo(torch.bfloat16).eps * max(float(want.float().abs().max()), 1.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)
