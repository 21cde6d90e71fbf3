"""DeepSeek-V4 config.json in both forms in use: the published Flash and Pro files (as released
and as transformers 5.24 rewrites them) parse to the presets, random small models parse the
same in both forms, and every contradictory or unknown value is refused naming its field."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_samples import tiny_hf_config
from repo_paths import MODEL_DATA, SAMPLES

from dsv4_cli.main import main
from dsv4_common.core.hf import from_hf_config, load_hf_config, parse_hf_config
from dsv4_common.core.model import DSV4Config, ModelConfig, ModelConfigError, Quantization
from dsv4_common.core.presets import PRESETS, load_model_config
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan

RELEASES = ("deepseek-v4-flash", "deepseek-v4-pro")
Raw = dict[str, Any]


def release(name: str, form: str = "") -> Raw:
    doc: Raw = json.loads((MODEL_DATA / f"{name}{form}" / "config.json").read_text())
    return doc


def parse(raw: Raw) -> ModelConfig:
    return from_hf_config(raw, name="m")


def same_model(a: ModelConfig, b: ModelConfig) -> bool:
    return dataclasses.replace(a, name="m") == dataclasses.replace(b, name="m")


# --- the published configs ---------------------------------------------------------------------


@pytest.mark.parametrize("name", RELEASES)
@pytest.mark.parametrize("form", ["", "-transformers"], ids=["release", "transformers"])
def test_published_config_equals_the_preset(name: str, form: str) -> None:
    """The committed files (README beside them) are the model the preset describes."""
    parsed = load_model_config(str(MODEL_DATA / f"{name}{form}"))
    assert same_model(parsed, PRESETS[name]())


def test_release_lists_no_qk_nope_head_dim_and_transformers_no_compress_ratios() -> None:
    """The two gaps that used to refuse them (issue #22): each form lacks the other's key."""
    for name in RELEASES:
        assert "qk_nope_head_dim" not in release(name) and "head_dim" in release(name)
        modern = release(name, "-transformers")
        assert "compress_ratios" not in modern and "layer_types" in modern
        assert "num_hash_layers" not in modern and "rope_scaling" not in modern


def test_tiny_sample_is_the_tiny_preset() -> None:
    assert same_model(parse(json.loads(tiny_hf_config())), PRESETS["tiny"]())


@pytest.mark.parametrize("name", RELEASES)
def test_kv_bytes_per_token_of_the_published_configs_equal_the_presets(name: str) -> None:
    def per_token(model: ModelConfig) -> list[tuple[float, float, int]]:
        inputs = PlanInputs(
            model=model, role="decode", gpu_memory_bytes=1000 * GIB, tp_size=8, pp_size=4
        )
        return [
            (
                r.layout.bytes_per_full_token,
                r.layout.bytes_per_swa_token,
                r.layout.bytes_per_request_slot,
            )
            for r in plan(inputs).ranks
        ]

    preset = per_token(PRESETS[name]())
    assert per_token(load_hf_config(MODEL_DATA / name / "config.json")) == preset
    assert per_token(load_hf_config(MODEL_DATA / f"{name}-transformers" / "config.json")) == preset


def test_pro_with_or_without_expert_dtype_is_the_same_fp4_model() -> None:
    """Pro's config.json as first published has no expert_dtype; its experts are FP4 all the
    same (as in vLLM, absent means fp4). Written out, at either level, it changes nothing."""
    plain = parse(release("deepseek-v4-pro"))
    top = parse({**release("deepseek-v4-pro"), "expert_dtype": "fp4"})
    raw = release("deepseek-v4-pro")
    raw["quantization_config"]["expert_dtype"] = "fp4"
    assert plain == top == parse(raw)
    assert isinstance(plain, DSV4Config) and plain.quantization == Quantization()


def test_storage_variants_are_read() -> None:
    flash = release("deepseek-v4-flash")
    fp8 = parse({**flash, "expert_dtype": "fp8"})
    assert isinstance(fp8, DSV4Config) and fp8.quantization
    assert fp8.quantization.expert_dtype == "fp8"
    raw = {**flash, "quantization_config": {"quant_method": "fp8"}}
    del raw["expert_dtype"]
    defaults = parse(raw)
    assert isinstance(defaults, DSV4Config)
    assert defaults.quantization == Quantization(scale_fmt="float", expert_dtype="fp4")
    raw = {k: v for k, v in flash.items() if k not in ("quantization_config", "expert_dtype")}
    unquantized = parse({**raw, "torch_dtype": "float32"})
    assert isinstance(unquantized, DSV4Config)
    assert (unquantized.quantization, unquantized.weight_dtype) == (None, "fp32")


@pytest.mark.parametrize(
    ("value", "kv", "indexer"),
    [
        (None, "fp8_e4m3", "fp8"),  # as released: the FP8 checkpoint's default
        ("auto", "fp8_e4m3", "fp8"),
        ("fp8", "fp8_e4m3", "fp8"),
        ("bfloat16", "bf16", "bf16"),
        ("bf16", "bf16", "bf16"),
        ("float32", "fp32", "fp32"),
    ],
)
def test_kv_cache_dtype_picks_the_rows(value: str | None, kv: str, indexer: str) -> None:
    flash = release("deepseek-v4-flash")
    assert "kv_cache_dtype" not in flash
    model = parse(flash if value is None else {**flash, "kv_cache_dtype": value})
    assert isinstance(model, DSV4Config)
    assert (model.kv_dtype, model.indexer_dtype) == (kv, indexer)
    assert model.kv_page_align_bytes == (576 if kv == "fp8_e4m3" else 1)


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_key() -> None:
    with pytest.raises(ModelConfigError, match="'kv_cache_dtype' has unknown value 'fp16'"):
        parse({**release("deepseek-v4-flash"), "kv_cache_dtype": "fp16"})


def test_cli_plans_the_published_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in RELEASES:
        for path in (MODEL_DATA / name, MODEL_DATA / f"{name}-transformers" / "config.json"):
            argv = ["plan", "--model", str(path), "--gpu", "h200", "--tp", "8", "--pp", "4"]
            assert main([*argv, "--json"]) == 0, capsys.readouterr().err
            doc = json.loads(capsys.readouterr().out)
            assert doc["max_context_tokens"] == 1 << 20 and len(doc["ranks"]) == 4


def test_cli_renders_the_flash_sample_from_the_published_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for form in ("", "-transformers"):
        config = MODEL_DATA / f"deepseek-v4-flash{form}" / "config.json"
        sample = SAMPLES / "flash-configmap.yaml"
        assert main(["render", str(sample), "--model-config", str(config)]) == 0
        out, err = capsys.readouterr()
        assert "kind: StatefulSet" in out and "dsv4-flash-config" in out, err


# --- both forms of random small models -----------------------------------------------------------


@st.composite
def small_release(draw: st.DrawFn) -> Raw:
    """A valid small DeepSeek-V4 config.json in the release's form."""
    n = draw(st.integers(1, 6))
    mtp = draw(st.integers(0, 2))
    hca = draw(st.sampled_from([128, 16]))  # the release's CSA ratio is 4
    ratios = draw(st.lists(st.sampled_from([0, 4, hca]), min_size=n, max_size=n))
    groups = draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    experts = draw(st.integers(1, 6))
    raw: Raw = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": n,
        "num_nextn_predict_layers": mtp,
        "compress_ratios": [*ratios, *[0] * mtp],
        "sliding_window": draw(st.sampled_from([4, 8, 128])),
        "head_dim": head_dim,
        "qk_rope_head_dim": draw(st.sampled_from([0, 4, 8, head_dim // 2])),
        "index_head_dim": draw(st.sampled_from([8, 16])),
        "index_n_heads": draw(st.integers(1, 8)),
        "index_topk": draw(st.integers(1, 64)),
        "hidden_size": draw(st.sampled_from([32, 64, 96])),
        "vocab_size": draw(st.integers(8, 300)),
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "q_lora_rank": draw(st.sampled_from([8, 32])),
        "o_lora_rank": draw(st.sampled_from([8, 16])),
        "o_groups": groups,
        "n_routed_experts": experts,
        "n_shared_experts": draw(st.integers(0, 2)),
        "num_experts_per_tok": draw(st.integers(1, experts)),
        "moe_intermediate_size": draw(st.sampled_from([16, 32])),
        "num_hash_layers": draw(st.integers(0, n)),
        "hc_mult": draw(st.integers(1, 4)),
        "hc_sinkhorn_iters": draw(st.integers(1, 30)),
        "scoring_func": draw(st.sampled_from(["sqrtsoftplus", "softmax", "sigmoid"])),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 1.5, 2.5])),
        "norm_topk_prob": draw(st.booleans()),
        "swiglu_limit": draw(st.sampled_from([0.0, 10.0])),
        "rope_theta": draw(st.sampled_from([10000, 50000.0])),
        "compress_rope_theta": draw(st.sampled_from([40000, 160000])),
        "max_position_embeddings": draw(st.sampled_from([1024, 4096])),
        "torch_dtype": draw(st.sampled_from(["bfloat16", "float32"])),
        "topk_method": "noaux_tc",
    }
    if draw(st.booleans()):
        raw["rope_scaling"] = {
            "type": "yarn",
            "factor": draw(st.sampled_from([2, 4, 16])),
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    if draw(st.booleans()):
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
        raw["expert_dtype"] = draw(st.sampled_from(["fp4", "fp8"]))
    return raw


def transformers_form(raw: Raw) -> Raw:
    """What transformers 5.24 writes for `raw` (its own conversion, run here). Its legacy
    fold knows ratios 0/4/128 only, so a ratio-16 model goes in as 128 + compress_rates."""
    transformers = pytest.importorskip("transformers")
    given = copy.deepcopy(raw)
    if 16 in given["compress_ratios"]:
        given["compress_ratios"] = [128 if r == 16 else r for r in given["compress_ratios"]]
        given["compress_rates"] = {
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": 16,
        }
    doc: Raw = json.loads(transformers.DeepseekV4Config(**given).to_json_string())
    return doc


FORMS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@FORMS
@given(raw=small_release())
def test_both_forms_of_a_small_model_parse_identically(raw: Raw) -> None:
    modern = transformers_form(raw)
    assert "compress_ratios" not in modern and "layer_types" in modern
    assert parse(modern) == parse(raw)


# --- refusals -------------------------------------------------------------------------------------

DELETE = object()


def edit(form: str, *path: Any, value: Any = DELETE) -> Callable[[], Raw]:
    """Flash's config.json in `form` ("" or "-transformers") with one value set (or deleted)."""

    def make() -> Raw:
        raw = release("deepseek-v4-flash", form)
        target = raw
        for key in path[:-1]:
            target = target[key]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return raw

    return make


def with_both_forms(ratio_at_2: int) -> Raw:
    raw = release("deepseek-v4-flash")
    raw["layer_types"] = release("deepseek-v4-flash", "-transformers")["layer_types"]
    raw["compress_ratios"][2] = ratio_at_2
    return raw


TF = "-transformers"
REFUSALS: list[tuple[str, Callable[[], Raw], str]] = [
    (
        "ratios-vs-layer-types",
        lambda: with_both_forms(128),
        "field 'compress_ratios[2]' (128) contradicts layer_types[2] "
        "('compressed_sparse_attention': ratio 4)",
    ),
    (
        "qk-nope",
        edit("", "qk_nope_head_dim", value=400),
        "field 'qk_nope_head_dim' (400) contradicts head_dim - qk_rope_head_dim (512 - 64 = 448)",
    ),
    (
        "partial-rotary-factor",
        edit(TF, "partial_rotary_factor", value=0.25),
        "field 'partial_rotary_factor' (0.25) x head_dim (512) = 128 contradicts "
        "qk_rope_head_dim (64)",
    ),
    ("kv-heads", edit("", "num_key_value_heads", value=8), "field 'num_key_value_heads' must be 1"),
    (
        "layer-type",
        edit(TF, "layer_types", 5, value="full_attention"),
        "field 'layer_types[5]' has unknown value 'full_attention'",
    ),
    (
        "compress-rates",
        edit(TF, "compress_rates", "sparse", value=4),
        "field 'compress_rates.sparse' is not a compressed layer type",
    ),
    (
        "scoring-func",
        edit("", "scoring_func", value="topk_softmax"),
        "field 'scoring_func' has unknown value 'topk_softmax'",
    ),
    (
        "rope-type",
        edit("", "rope_scaling", "type", value="linear"),
        "field 'rope_scaling.type' has unknown value 'linear': expected yarn or default",
    ),
    (
        "rope-type-transformers",
        edit(TF, "rope_parameters", "compress", value={"rope_type": "longrope", "factor": 16}),
        "field 'rope_parameters.compress.rope_type' has unknown value 'longrope'",
    ),
    (
        "main-rope-type",
        edit(TF, "rope_parameters", "main", "rope_type", value="yarn"),
        "field 'rope_parameters.main.rope_type' has unknown value 'yarn': expected default",
    ),
    (
        "rope-theta",
        edit(TF, "rope_theta", value=20000),
        "field 'rope_theta' (20000) contradicts rope_parameters.main.rope_theta (10000)",
    ),
    (
        "yarn-attention-factor",
        edit(TF, "rope_parameters", "compress", "attention_factor", value=1.277),
        "field 'rope_parameters.compress.attention_factor' must be 1.0",
    ),
    (
        "quant-method",
        edit("", "quantization_config", "quant_method", value="awq"),
        "field 'quantization_config.quant_method' has unknown value 'awq': expected fp8",
    ),
    (
        "fmt",
        edit("", "quantization_config", "fmt", value="e5m2"),
        "field 'quantization_config.fmt' must be 'e4m3'",
    ),
    (
        "scale-fmt",
        edit("", "quantization_config", "scale_fmt", value="e4m3"),
        "field 'quantization_config.scale_fmt' has unknown value 'e4m3'",
    ),
    (
        "weight-block-size",
        edit("", "quantization_config", "weight_block_size", value=[64, 64]),
        "field 'quantization_config.weight_block_size' must be [128, 128] for FP8, got [64, 64]",
    ),
    (
        "quantization-key",
        edit("", "quantization_config", "ignored_layers", value=["head"]),
        "field 'quantization_config.ignored_layers' is not understood",
    ),
    (
        "expert-dtype",
        edit("", "expert_dtype", value="int4"),
        "field 'expert_dtype' has unknown value 'int4': expected fp4 or fp8",
    ),
    (
        "expert-dtype-twice",
        edit(TF, "expert_dtype", value="fp8"),
        "field 'expert_dtype' ('fp8') contradicts quantization_config.expert_dtype ('fp4')",
    ),
    (
        "expert-dtype-unquantized",
        edit("", "quantization_config"),
        "field 'expert_dtype' needs a quantization_config",
    ),
    (
        "torch-dtype",
        edit("", "torch_dtype", value="float8"),
        "field 'torch_dtype' has unknown value 'float8'",
    ),
    (
        "hash-after-moe",
        edit(TF, "mlp_layer_types", 4, value="hash_moe"),
        "field 'mlp_layer_types[4]' is hash_moe after moe: hash-routed layers must come first",
    ),
    (
        "hash-layers-twice",
        edit(TF, "num_hash_layers", value=2),
        "field 'num_hash_layers' (2) contradicts mlp_layer_types (3 hash_moe)",
    ),
    (
        "ratio",
        edit("", "compress_ratios", 2, value=8),
        "field 'compress_ratios' values [8] not in [0, 4, 16, 128]",
    ),
    (
        "topk-method",
        edit("", "topk_method", value="group_limited_greedy"),
        "field 'topk_method' must be 'noaux_tc'",
    ),
    (
        "window",
        edit("", "window_size", value=64),
        "field 'window_size' (64) contradicts sliding_window (128)",
    ),
    (
        "tied-head",
        edit("", "tie_word_embeddings", value=True),
        "field 'tie_word_embeddings' must be false",
    ),
    (
        "no-hash-layers",
        edit("", "num_hash_layers"),
        "missing required field 'num_hash_layers' (or 'mlp_layer_types')",
    ),
    (
        "no-rotary-dims",
        edit("", "qk_rope_head_dim"),
        "missing required field 'qk_rope_head_dim'",
    ),
]


@pytest.mark.parametrize(
    ("make", "needle"), [(m, n) for _, m, n in REFUSALS], ids=[i for i, _, _ in REFUSALS]
)
def test_contradictory_or_unknown_values_are_refused_naming_the_field(
    make: Callable[[], Raw], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = make()
    with pytest.raises(ModelConfigError) as info:
        parse(raw)
    assert needle in str(info.value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert main(["plan", "--model", str(path), "--gpu", "h200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 plan: error: --model:") and needle in err


def test_unknown_top_level_keys_are_tolerated() -> None:
    raw = {**release("deepseek-v4-flash"), "dspark_block_size": 5, "n_group": 1, "foo": [1]}
    assert parse(raw) == parse(release("deepseek-v4-flash"))


def test_the_config_map_text_parses_like_the_file() -> None:
    path = MODEL_DATA / "deepseek-v4-pro" / "config.json"
    assert parse_hf_config(path.read_text(), name="deepseek-v4-pro") == load_hf_config(path)
