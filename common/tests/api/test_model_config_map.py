"""`spec.model.configMapRef`: parsed (exactly one model source, the field named), planned from
the config.json text the operator reads, refused by name where no cluster can be read, and
given to the workers as a file path in their rank config."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from model_samples import tiny_hf_config

from dsv4_common.api.deployment import (
    MemoryPlanError,
    load_model,
    model_from_config_map,
    plan_memory,
)
from dsv4_common.api.rank_config import (
    MODEL_CONFIG_DIR,
    build_rank_config,
    parse_rank_config,
    rank_config_to_dict,
)
from dsv4_common.api.spec import ConfigMapRef, SpecError, parse_meta, parse_spec
from dsv4_common.core.hf import load_hf_config, parse_hf_config
from dsv4_common.core.model import ModelConfigError

BODY: dict[str, Any] = {
    "apiVersion": "serving.dsv4.io/v1alpha1",
    "kind": "DSV4Deployment",
    "metadata": {"name": "cm", "namespace": "team-a"},
    "spec": {
        "model": {"configMapRef": {"name": "tiny-model"}},
        "maxContextTokens": 4096,
        "gpu": {"type": "h100-80gb", "perPod": 1},
        "prefill": {"pipelineParallel": 2},
    },
}


def body_with(model: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(BODY)
    body["spec"]["model"] = model
    return body


def test_config_map_ref_parses_with_the_default_key() -> None:
    model = parse_spec(BODY).model
    assert model.config_map == ConfigMapRef(name="tiny-model", key="config.json")
    assert model.preset is None and model.config_path is None
    keyed = parse_spec(body_with({"configMapRef": {"name": "m.v2", "key": "deepseek.json"}}))
    assert keyed.model.config_map == ConfigMapRef(name="m.v2", key="deepseek.json")


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"preset": "tiny", "configMapRef": {"name": "m"}},
        {"configPath": "/m/config.json", "configMapRef": {"name": "m"}},
        {"preset": "tiny", "configPath": "/m/config.json", "configMapRef": {"name": "m"}},
    ],
    ids=["none", "preset+ref", "path+ref", "all"],
)
def test_exactly_one_model_source_naming_all_three(model: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(body_with(model))
    assert any(
        e.startswith(
            "spec.model: exactly one of model.preset, model.configPath and model.configMapRef"
        )
        for e in info.value.errors
    ), info.value.errors


@pytest.mark.parametrize(
    ("ref", "field"),
    [
        ({}, "spec.model.configMapRef.name: required"),
        ({"name": "Tiny_Model"}, "spec.model.configMapRef.name: must be a ConfigMap name"),
        ({"name": "m", "key": "a/b"}, "spec.model.configMapRef.key: must be a ConfigMap data key"),
        ({"name": "m", "namespace": "other"}, "spec.model.configMapRef.namespace: unknown field"),
        ("m", "spec.model.configMapRef: must be an object"),
    ],
)
def test_config_map_ref_errors_name_the_field(ref: Any, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(body_with({"configMapRef": ref}))
    assert any(e.startswith(field) for e in info.value.errors), info.value.errors


def test_a_config_map_model_needs_a_gpu() -> None:
    body = copy.deepcopy(BODY)
    body["spec"]["gpu"] = {"memoryGiB": 0, "perPod": 0}
    with pytest.raises(SpecError, match=r"spec\.gpu\.type: required for this model"):
        parse_spec(body)


def test_config_text_parses_as_the_file_does(tmp_path: Path) -> None:
    path = tmp_path / "tiny-model" / "config.json"
    path.parent.mkdir()
    path.write_text(tiny_hf_config())
    assert parse_hf_config(tiny_hf_config(), name="tiny-model") == load_hf_config(path)
    with pytest.raises(ModelConfigError, match=r"^ConfigMap x: not valid JSON"):
        parse_hf_config("{", name="x", where="ConfigMap x")
    with pytest.raises(ModelConfigError, match=r"^config\.json: expected a JSON object"):
        parse_hf_config("[]", name="x")


def test_without_the_config_map_text_planning_names_the_field() -> None:
    """`dsv4 render` and `dsv4 up` have no cluster to read the ConfigMap from."""
    spec = parse_spec(BODY)
    with pytest.raises(MemoryPlanError, match=r"^spec\.model\.configMapRef: .*configPath"):
        load_model(spec)
    with pytest.raises(MemoryPlanError, match=r"^spec\.model\.configMapRef: .*--model-config"):
        plan_memory(spec)


def test_the_model_in_the_config_map_is_planned() -> None:
    spec = parse_spec(BODY)
    six = plan_memory(spec, model_from_config_map(spec, tiny_hf_config(num_hidden_layers=6)))
    four = plan_memory(spec, model_from_config_map(spec, tiny_hf_config(num_hidden_layers=4)))
    assert [r.layers for r in six.prefill.ranks] == [(0, 3), (3, 6)]
    assert [r.layers for r in four.prefill.ranks] == [(0, 2), (2, 4)]
    assert six.prefill.inputs.model.name == "tiny-model"  # named after the ConfigMap
    smaller = tiny_hf_config(max_position_embeddings=2048)
    assert plan_memory(spec, model_from_config_map(spec, smaller)).model_context_tokens == 2048


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "ConfigMap 'tiny-model' key 'config.json': not valid JSON"),
        ("{}", "config.json is neither DeepSeek-V4"),
        (
            json.dumps({**json.loads(tiny_hf_config()), "qk_rope_head_dim": "8"}),
            "'qk_rope_head_dim' must be an integer",
        ),
    ],
)
def test_a_bad_config_in_the_config_map_names_the_field(text: str, needle: str) -> None:
    spec = parse_spec(BODY)
    with pytest.raises(MemoryPlanError, match=r"^spec\.model\.configMapRef: ") as info:
        model_from_config_map(spec, text)
    assert needle in str(info.value)


def test_rank_config_points_the_worker_at_the_mounted_file() -> None:
    spec, meta = parse_spec(BODY), parse_meta(BODY)
    memory = plan_memory(spec, model_from_config_map(spec, tiny_hf_config()))
    config = build_rank_config(
        spec,
        meta,
        memory,
        "prefill",
        1,
        peers_host_template="{group}-{rank}",
        role_services={"prefill": "p", "decode": "d"},
    )
    path = f"{MODEL_CONFIG_DIR}/tiny-model/config.json"
    assert (config.model.preset, config.model.config_path) == (None, path)
    assert parse_rank_config(rank_config_to_dict(config)).model.source == path
    # What the worker loads from there is the model the operator planned.
    assert Path(path).parent.name == memory.prefill.inputs.model.name
