"""The reference models' naive forward (the oracle): causality, the DSV4 attention pattern,
online c128 state == ring state, seeded weights and safetensors round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import tiny_moe, ulp_tolerance

from dsv4_common.core.model import ModelConfig
from dsv4_common.core.presets import hybrid_tiny, tiny
from dsv4_worker.model import compressor as C
from dsv4_worker.model.oracle import compressed_rows, oracle_greedy, oracle_logits
from dsv4_worker.model.weights import (
    WeightsError,
    init_weights,
    load_weights,
    param_shapes,
    save_weights,
)

MODELS = [tiny(), hybrid_tiny()]
IDS = [((7 * i) % 250) + 3 for i in range(70)]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_a_position_never_sees_later_tokens(model: ModelConfig) -> None:
    """Also batch invariance: the same prefix gives the same logits in a longer batch."""
    p = init_weights(model, seed=1)
    full = oracle_logits(model, p, IDS)
    # Past 36 tokens tiny's CSA layers hold more compressed rows than the indexer's top-k.
    for cut in range(1, len(IDS), 5):
        assert torch.allclose(oracle_logits(model, p, IDS[:cut]), full[:cut], atol=1e-9)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_changing_an_early_token_changes_later_logits(model: ModelConfig) -> None:
    """Information flows past the window: through compressed rows (DSV4) or full layers."""
    p = init_weights(model, seed=1)
    changed = [IDS[0] + 1, *IDS[1:]]
    base, other = oracle_logits(model, p, IDS), oracle_logits(model, p, changed)
    far = model.window_tokens * 4
    assert not torch.allclose(base[far:], other[far:], atol=1e-4)


def _window_only_logits(widen_window_by: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """tiny with every compress ratio 0: the logits of IDS and of IDS with token 0 changed,
    and the stack's receptive field. `widen_window_by` breaks the oracle's window mask on
    purpose (each layer sees that many tokens more), for the check's negative control."""
    import dataclasses

    from dsv4_worker.model import oracle

    model = dataclasses.replace(tiny(), compress_ratios=(0,) * 7)
    p = init_weights(model, seed=2)
    changed = [IDS[0] + 1, *IDS[1:]]
    reach = model.num_hidden_layers * (model.window_tokens - 1)  # receptive field of the stack
    mask = oracle._window_mask
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(oracle, "_window_mask", lambda t, w, dev: mask(t, w + widen_window_by, dev))
        return oracle_logits(model, p, IDS), oracle_logits(model, p, changed), reach


def _past_reach_differs(base: torch.Tensor, other: torch.Tensor, reach: int) -> torch.Tensor:
    """Per row past the receptive field: whether the two runs differ beyond float noise.

    Not bit equality: changing token 0 changes which tokens each expert's matmul sees (hash
    routing), and a BLAS kernel's result for a row may depend on how many rows it is computed
    with (seen on an AVX-512 EPYC: 8 of 27 rows off by up to 2.1e-14, ~6 ulps of the logits'
    scale). A token that leaks through the window moves these rows by >= 1e-5 (the control)."""
    tol = ulp_tolerance(base, ulps=64)  # ~2.4e-13 at tiny's logit scale (~17)
    return ((base[reach + 1 :] - other[reach + 1 :]).abs() > tol).any(dim=-1)


def test_dsv4_window_only_model_forgets_what_left_the_window() -> None:
    """With every compress ratio 0, a token outside every layer's window cannot matter."""
    base, other, reach = _window_only_logits()
    assert not _past_reach_differs(base, other, reach).any()
    assert not torch.allclose(base[:reach], other[:reach])


def test_the_window_check_sees_a_one_token_leak() -> None:
    """The negative control: with the window mask one token wider, token 0 reaches the rows
    just past the (true) receptive field, and the check above says so."""
    base, other, reach = _window_only_logits(widen_window_by=1)
    assert _past_reach_differs(base, other, reach)[:6].all()  # 6 layers: 6 rows more reach


@pytest.mark.parametrize("length", [16, 47, 64, 70])  # on a c16 block boundary and mid-block
def test_online_c16_state_equals_the_ring(length: int) -> None:
    model = tiny()
    p = init_weights(model, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(length, model.weights.hidden_size, generator=gen, dtype=torch.float64)
    pos = torch.arange(length)
    for layer in (2, 4):  # the ratio-16 (HCA) layers of tiny
        ring = compressed_rows(model, p, layer, x, pos, request_state="ring")
        online = compressed_rows(model, p, layer, x, pos, request_state="online")
        assert ring.shape == (length // 16, model.head_dim)
        assert torch.allclose(ring, online, atol=1e-2)  # both rounded to bf16 rows
    prompt = IDS[:length]
    assert oracle_greedy(model, p, prompt, 12) == oracle_greedy(
        model, p, prompt, 12, request_state="online"
    )


def test_online_pooling_is_the_block_softmax_before_rounding() -> None:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randn(16, 2 * 32, generator=gen, dtype=torch.float64) * 3
    state = None
    for token in tokens:
        state = C.online_update(state, token)
    assert state is not None
    assert torch.allclose(C.online_pooled(state), C.pool_block(None, tokens, False), atol=1e-12)


def test_the_overlapped_compressor_mixes_the_previous_block() -> None:
    gen = torch.Generator().manual_seed(6)
    prev, curr = torch.randn(4, 4 * 8, generator=gen), torch.randn(4, 4 * 8, generator=gen)
    with_prev, alone = C.pool_block(prev, curr, True), C.pool_block(None, curr, True)
    assert not torch.allclose(with_prev, alone)
    # Only the previous block's `_prev` halves matter: changing its `_curr` halves does not.
    prev2 = prev.clone()
    prev2[:, 8:16] += 5
    prev2[:, 24:32] += 5
    # Bit equality is right: both calls run the same ops on the same shapes, and the values
    # they read (prev's `_prev` halves, curr) are the same bits.
    assert torch.equal(C.pool_block(prev2, curr, True), with_prev)


def test_seeded_weights_are_reproducible_and_seed_dependent() -> None:
    a, b, c = init_weights(tiny(), 7), init_weights(tiny(), 7), init_weights(tiny(), 8)
    # Bit equality is right: one seeded generator draws the same values; no arithmetic.
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])
    assert {k: tuple(v.shape) for k, v in a.items()} == param_shapes(tiny())


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_safetensors_round_trip_gives_the_same_tokens(model: ModelConfig, tmp_path: Path) -> None:
    p = init_weights(model, seed=9)
    path = tmp_path / "model.safetensors"
    save_weights(path, p)
    loaded = load_weights(path, model)
    assert oracle_greedy(model, loaded, IDS[:20], 8) == oracle_greedy(model, p, IDS[:20], 8)


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_weights(path, init_weights(hybrid_tiny(), seed=1))
    with pytest.raises(WeightsError, match="does not match tiny"):
        load_weights(path, tiny())
    p = init_weights(tiny(), seed=1)
    p["head.weight"] = p["head.weight"][:, :10]
    save_weights(path, p)
    with pytest.raises(WeightsError, match=r"head.weight: shape \(256, 10\)"):
        load_weights(path, tiny())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_cuda_oracle_equals_cpu(model: ModelConfig) -> None:
    cpu = init_weights(model, seed=11)
    gpu = init_weights(model, seed=11, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert torch.allclose(
        oracle_logits(model, gpu, IDS).cpu(), oracle_logits(model, cpu, IDS), atol=1e-3
    )
    assert oracle_greedy(model, gpu, IDS[:30], 10) == oracle_greedy(model, cpu, IDS[:30], 10)


def test_moe_layers_route_each_token_to_k_experts() -> None:
    model = tiny_moe()
    p = init_weights(model, seed=12)
    assert "layers.0.ffn.gate.tid2eid" in p and "layers.0.ffn.gate.bias" not in p  # hash layer
    assert "layers.1.ffn.gate.bias" in p and "layers.1.ffn.gate.tid2eid" not in p  # top-k layer
    assert "layers.2.ffn.experts.3.w2.weight" in p
    assert "layers.2.ffn.shared_experts.w3.weight" in p
    base = oracle_logits(model, p, IDS[:40])
    p_top4 = init_weights(tiny_moe(4), seed=12)
    assert not torch.allclose(oracle_logits(tiny_moe(4), p_top4, IDS[:40]), base)
    for cut in (5, 23):  # batch invariance holds through the router too
        assert torch.allclose(oracle_logits(model, p, IDS[:cut]), base[:cut], atol=1e-9)


def test_more_experts_per_token_than_experts_is_refused() -> None:
    from dsv4_common.core.model import ModelConfigError

    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        tiny_moe(5)


def test_dense_ffn_layers_are_refused_not_computed_as_moe() -> None:
    """The planner counts first_k_dense_replace layers' dense weights (core/tensors.py, the
    shapes the worker uses too); the worker's model has no dense FFN, so it refuses them."""
    import dataclasses

    weights = dataclasses.replace(tiny().weights, num_dense_layers=1, intermediate_size=64)
    with pytest.raises(NotImplementedError, match="first_k_dense_replace"):
        param_shapes(dataclasses.replace(tiny(), weights=weights))
