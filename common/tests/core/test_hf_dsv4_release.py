"""`release_config` is the parser's inverse: every DeepSeek-V4 preset and random models of every
setting the parser reads come back unchanged (through JSON text too), the published files agree
with it on every key both carry, and a model no config.json can describe is refused by field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import MODEL_DATA

from dsv4_common.core.hf_dsv4 import dsv4_from_hf, release_config
from dsv4_common.core.model import (
    DSV4Arch,
    DSV4Config,
    ModelConfigError,
    Quantization,
    WeightShape,
    YarnScaling,
)
from dsv4_common.core.presets import PRESETS, tiny

DSV4_PRESETS = sorted(n for n, make in PRESETS.items() if isinstance(make(), DSV4Config))


def round_trip(model: DSV4Config) -> DSV4Config:
    """The model through release_config, JSON text and the parser."""
    text = json.dumps(release_config(model))
    return dsv4_from_hf(json.loads(text), model.name)


@pytest.mark.parametrize("name", DSV4_PRESETS)
def test_every_dsv4_preset_parses_back_from_its_release_config(name: str) -> None:
    model = PRESETS[name]()
    assert isinstance(model, DSV4Config)
    assert dsv4_from_hf(release_config(model), model.name) == model
    assert round_trip(model) == model


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_release_config_agrees_with_the_published_file_on_every_shared_key(name: str) -> None:
    published: dict[str, Any] = json.loads((MODEL_DATA / name / "config.json").read_text())
    model = PRESETS[name]()
    assert isinstance(model, DSV4Config)
    ours = release_config(model)
    shared = sorted(set(ours) & set(published))
    assert len(shared) >= 40
    assert {k: ours[k] for k in shared} == {k: published[k] for k in shared}


# --- random models of every setting the parser reads ------------------------------------------

_FLOATS = st.floats(min_value=1e-9, max_value=1e3, allow_nan=False, allow_infinity=False)


@st.composite
def dsv4_models(draw: st.DrawFn) -> DSV4Config:
    """A valid DSV4Config in the parser's image (derived fields as the parser derives them)."""
    n = draw(st.integers(1, 6))
    mtp = draw(st.integers(0, 2))
    sparse = draw(st.sampled_from([4, 4, 16, 128]))
    other = draw(st.sampled_from([r for r in (4, 16, 128) if r != sparse]))
    used = [0, sparse, other] if sparse != 4 else [0, 4, 16, 128]
    ratios = draw(st.lists(st.sampled_from(used), min_size=n, max_size=n))
    groups = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.integers(1, 8))
    dense = draw(st.integers(0, n))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    rope = draw(st.sampled_from([0, 2, 8, head_dim // 2]))
    quantization = draw(
        st.none()
        | st.builds(
            Quantization,
            scale_fmt=st.sampled_from(["ue8m0", "float"]),
            expert_dtype=st.sampled_from(["fp4", "fp8"]),
        )
    )
    kv = draw(st.sampled_from(["fp8_e4m3", "bf16", "fp32"]))
    fp8 = kv == "fp8_e4m3"
    yarn = draw(
        st.none()
        | st.builds(
            YarnScaling,
            factor=st.floats(1.0, 64.0),
            original_max_position_embeddings=st.integers(1, 1 << 20),
            beta_fast=st.floats(2.0, 64.0),
            beta_slow=st.floats(0.0, 1.5),
        )
    )
    return DSV4Config(
        name=draw(st.sampled_from(["m", "tiny", "x-1"])),
        num_hidden_layers=n,
        compress_ratios=(*ratios, *[0] * mtp),
        num_nextn_predict_layers=mtp,
        window_tokens=draw(st.integers(1, 256)),
        qk_nope_head_dim=head_dim - rope,
        qk_rope_head_dim=rope,
        index_head_dim=draw(st.sampled_from([8, 16, 128])),
        index_n_heads=draw(st.integers(1, 64)),
        index_topk=draw(st.integers(1, 1024)),
        kv_dtype=kv,
        indexer_dtype="fp8" if fp8 else kv,
        state_dtype="fp32",
        weights=WeightShape(
            hidden_size=draw(st.sampled_from([32, 64, 4096])),
            vocab_size=draw(st.integers(1, 200_000)),
            num_attention_heads=groups * draw(st.integers(1, 4)),
            intermediate_size=draw(st.integers(1, 512)) if dense else 0,
            num_dense_layers=dense,
            num_routed_experts=experts,
            num_shared_experts=draw(st.integers(0, 2)),
            moe_intermediate_size=draw(st.integers(1, 64)),
            num_experts_per_token=draw(st.integers(1, experts)),
            q_lora_rank=draw(st.integers(1, 64)),
            o_lora_rank=draw(st.integers(1, 64)),
        ),
        max_position_embeddings=draw(st.integers(1, 1 << 20)),
        sparse_ratio=sparse,
        kv_page_align_bytes=576 if fp8 else 1,
        arch=DSV4Arch(
            hc_mult=draw(st.integers(1, 8)),
            hc_sinkhorn_iters=draw(st.integers(1, 40)),
            hc_eps=draw(_FLOATS),
            o_groups=groups,
            num_hash_layers=draw(st.integers(0, n)),
            scoring_func=draw(st.sampled_from(["sqrtsoftplus", "softmax", "sigmoid"])),
            routed_scaling_factor=draw(_FLOATS),
            norm_topk_prob=draw(st.booleans()),
            swiglu_limit=draw(st.sampled_from([0.0, 7.5, 10.0])),
            rope_theta=draw(st.floats(1.0, 1e7)),
            compress_rope_theta=draw(st.floats(1.0, 1e7)),
            rope_scaling=yarn,
            rms_norm_eps=draw(_FLOATS),
        ),
        quantization=quantization,
        weight_dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
    )


@settings(max_examples=300, deadline=None)
@given(model=dsv4_models())
def test_a_random_model_parses_back_from_its_release_config(model: DSV4Config) -> None:
    assert dsv4_from_hf(release_config(model), model.name) == model
    assert round_trip(model) == model


def test_a_short_mtp_tail_is_written_out_in_full() -> None:
    model = dataclasses.replace(tiny(), compress_ratios=tiny().compress_ratios[:-1])
    assert release_config(model)["compress_ratios"] == list(tiny().compress_ratios)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"indexer_dtype": "bf16"}, "indexer_dtype"),
        ({"state_dtype": "bf16"}, "state_dtype"),
        ({"kv_page_align_bytes": 576}, "kv_page_align_bytes"),
        ({"sparse_ratio": 16, "compress_ratios": (0, 4, 16, 128, 0, 0, 0)}, "sparse_ratio"),
        ({"weights": dataclasses.replace(tiny().weights, intermediate_size=8)}, "intermediate"),
    ],
)
def test_a_model_config_json_cannot_describe_is_refused_naming_the_field(
    change: dict[str, Any], field: str
) -> None:
    model = dataclasses.replace(tiny(), **change)
    with pytest.raises(ModelConfigError, match=field):
        release_config(model)


@settings(max_examples=100, deadline=None)
@given(model=dsv4_models())
def test_transformers_reads_the_ratios_of_a_release_config(model: DSV4Config) -> None:
    """transformers (5.24) folds compress_ratios by a fixed table (0, 4, 128): a model with
    another ratio (tiny's 16) or CSA ratio is written with layer_types + compress_rates too,
    whenever one HCA rate can say it, and transformers' config reads back our ratios."""
    transformers = pytest.importorskip("transformers")
    raw = release_config(model)
    hca = set(model.target_ratios) - {0, model.sparse_ratio}
    if len(hca) > 1:  # transformers has one HCA rate: such a model is ours alone
        return
    config = transformers.DeepseekV4Config(**raw)
    rates = {"sliding_attention": 0, **config.compress_rates}
    assert [rates[t] for t in config.layer_types] == list(model.target_ratios)
    assert ("layer_types" in raw) == (
        bool(set(model.target_ratios) - {0, 4, 128}) or model.sparse_ratio != 4
    )
