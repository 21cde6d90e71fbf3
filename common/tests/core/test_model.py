"""Model configs: presets, HuggingFace config.json loading, field errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import MODEL_DATA

from dsv4_common.core.model import DSV4Config, HybridSWAConfig, ModelConfigError
from dsv4_common.core.presets import PRESETS, deepseek_v4_pro, load_model_config
from dsv4_common.plan.weights import estimate_weight_bytes


def _pro_hf() -> dict[str, object]:
    """DeepSeek-V4-Pro's config.json as released."""
    doc: dict[str, object] = json.loads(
        (MODEL_DATA / "deepseek-v4-pro" / "config.json").read_text()
    )
    return doc


def test_presets_have_the_documented_layer_patterns() -> None:
    flash, pro, tiny = (PRESETS[n]() for n in ("deepseek-v4-flash", "deepseek-v4-pro", "tiny"))
    assert isinstance(flash, DSV4Config) and isinstance(pro, DSV4Config)
    assert isinstance(tiny, DSV4Config)
    assert (
        flash.target_ratios.count(4),
        flash.target_ratios.count(128),
        flash.target_ratios.count(0),
    ) == (21, 20, 2)
    assert (pro.target_ratios.count(4), pro.target_ratios.count(128)) == (30, 31)
    assert len(pro.compress_ratios) == 62 and pro.compress_ratios[-1] == 0
    assert tiny.window_tokens <= 16 and set(tiny.compress_ratios) <= {0, 4, 16}


def test_hf_config_json_loads_to_the_same_kv_shape_as_the_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_pro_hf()))
    loaded = load_model_config(str(tmp_path))
    assert isinstance(loaded, DSV4Config)
    preset = deepseek_v4_pro()
    for field in (
        "compress_ratios",
        "num_hidden_layers",
        "window_tokens",
        "qk_nope_head_dim",
        "kv_dtype",
        "state_dtype",
        "kv_page_align_bytes",
    ):
        assert getattr(loaded, field) == getattr(preset, field), field


def test_hybrid_config_from_sliding_window_pattern(tmp_path: Path) -> None:
    raw = {
        "num_hidden_layers": 12,
        "sliding_window_pattern": 6,
        "sliding_window": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2048,
        "vocab_size": 262144,
        "intermediate_size": 8192,
    }
    path = tmp_path / "gemma.json"
    path.write_text(json.dumps(raw))
    model = load_model_config(str(path))
    assert isinstance(model, HybridSWAConfig)
    assert [i for i, t in enumerate(model.layer_types) if t == "full"] == [5, 11]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda c: c.pop("qk_rope_head_dim"), "missing required field 'qk_rope_head_dim'"),
        (lambda c: c.update(compress_ratios=[4] * 70), "'compress_ratios' has 70 entries"),
        (lambda c: c.update(compress_ratios=[3] * 62), "values [3] not in"),
        (lambda c: c.update(num_hidden_layers="61"), "'num_hidden_layers' must be an integer"),
        (lambda c: c.update(compress_ratios=[4] * 62), "MTP (tail) entries must be 0"),
    ],
)
def test_bad_config_json_names_the_field(tmp_path: Path, mutate: object, needle: str) -> None:
    raw = _pro_hf()
    mutate(raw)  # type: ignore[operator]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError) as info:
        load_model_config(str(path))
    assert needle in str(info.value)


def test_unknown_model_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_model_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model_config(str(bad))


def test_weight_estimate_places_embedding_head_and_mtp() -> None:
    pro = deepseek_v4_pro()
    total = estimate_weight_bytes(
        pro, range(61), first=True, last=True, with_draft=False, tp_size=1
    )
    # ~1.55 T routed-expert parameters at FP4 (+ scales) dominate: roughly 0.8-0.9 TB
    assert 0.75e12 < total < 0.95e12
    mid = estimate_weight_bytes(
        pro, range(16, 31), first=False, last=False, with_draft=False, tp_size=1
    )
    first = estimate_weight_bytes(
        pro, range(16, 31), first=True, last=False, with_draft=False, tp_size=1
    )
    last_mtp = estimate_weight_bytes(
        pro, range(16, 31), first=False, last=True, with_draft=True, tp_size=1
    )
    embedding = 129280 * 7168 * 2
    assert first - mid == embedding
    assert last_mtp - mid > embedding  # head + the MTP layer
    tp8 = estimate_weight_bytes(
        pro, range(16, 31), first=False, last=False, with_draft=False, tp_size=8
    )
    # TP splits the experts, heads and vocabulary; the small rest is on every GPU
    assert mid < tp8 * 8 < mid * 1.05
