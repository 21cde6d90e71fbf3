"""HuggingFace `config.json` -> a model config: DeepSeek-V4 (both forms in use, in
`hf_dsv4.py`) or generic hybrid SWA (here). Pure; every malformed field raises
ModelConfigError naming it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from dsv4_common.core.hf_dsv4 import dsv4_from_hf, is_dsv4
from dsv4_common.core.model import (
    MAX_LAYERS,
    HybridSWAConfig,
    LayerType,
    ModelConfig,
    ModelConfigError,
    WeightShape,
)

# A Hugging Face hub cache snapshot: .../models--ORG--NAME/snapshots/REVISION/config.json
_HUB_SNAPSHOT = re.compile(r"^models--(?P<repo>.+)$")


def load_hf_config(path: Path) -> ModelConfig:
    """Read a HuggingFace `config.json` file; the model's name is `config_model_name`'s."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read ({exc})") from exc
    where = PurePath(os.path.normpath(path.absolute()))
    return parse_hf_config(text, name=config_model_name(where), where=str(path))


def config_model_name(config_file: PurePath) -> str:
    """The name of the model whose config.json is `config_file` (an absolute, normalized path):
    its directory's name, except in a Hugging Face hub cache, whose snapshot directories are
    named by revision: there, the repository id (`models--deepseek-ai--X/snapshots/REV` ->
    `deepseek-ai/X`). A config.json's own fields are not used: DeepSeek-V4's carry no name,
    transformers >= 5 writes none, and the `_name_or_path` older versions wrote is the path or
    id the weights were loaded from (a fine-tune's base model, a training machine's path)."""
    directory = config_file.parent
    snapshots = directory.parent
    if snapshots.name == "snapshots" and (hub := _HUB_SNAPSHOT.match(snapshots.parent.name)):
        return hub["repo"].replace("--", "/")
    return directory.name or config_file.stem


def parse_hf_config(text: str, name: str, where: str = "config.json") -> ModelConfig:
    """A HuggingFace `config.json` given as text (a file's, a ConfigMap's); `where` names its
    origin in errors."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: expected a JSON object")
    return from_hf_config(raw, name=name)


def from_hf_config(raw: Mapping[str, Any], name: str) -> ModelConfig:
    """Build a config from a HuggingFace config dict: DeepSeek-V4 (model_type deepseek_v4,
    `compress_ratios` or its layer types; `hf_dsv4.py`) or generic hybrid SWA."""
    if is_dsv4(raw):
        return dsv4_from_hf(raw, name)
    if "layer_types" in raw or "sliding_window_pattern" in raw:
        return _hybrid_from_hf(raw, name)
    raise ModelConfigError(
        "config.json is neither DeepSeek-V4 (no 'compress_ratios') nor hybrid-SWA "
        "(no 'layer_types' / 'sliding_window_pattern')"
    )


def _get(raw: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in raw:
        return raw[key]
    if default is None:
        raise ModelConfigError(f"config.json is missing required field '{key}'")
    return default


def _int(
    raw: Mapping[str, Any], key: str, default: int | None = None, minimum: int | None = None
) -> int:
    """An integer field; bounds are the config types' to check, except `minimum`, which guards
    arithmetic done here before the config exists."""
    value = _get(raw, key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"config.json field '{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ModelConfigError(f"config.json field '{key}' must be >= {minimum}, got {value}")
    return value


def _weights_from_hf(raw: Mapping[str, Any]) -> WeightShape:
    routed = _int(raw, "n_routed_experts", 0)
    return WeightShape(
        hidden_size=_int(raw, "hidden_size"),
        vocab_size=_int(raw, "vocab_size"),
        num_attention_heads=_int(raw, "num_attention_heads"),
        intermediate_size=_int(raw, "intermediate_size", 0),
        num_routed_experts=routed,
        num_shared_experts=_int(raw, "n_shared_experts", 0),
        moe_intermediate_size=_int(raw, "moe_intermediate_size", 0),
        num_experts_per_token=_int(raw, "num_experts_per_tok", min(8, routed) if routed else 8),
    )


def _hybrid_from_hf(raw: Mapping[str, Any], name: str) -> HybridSWAConfig:
    n_layers = _int(raw, "num_hidden_layers", minimum=1)
    if n_layers > MAX_LAYERS:
        raise ModelConfigError(
            f"config.json field 'num_hidden_layers' must be <= {MAX_LAYERS}, got {n_layers}"
        )
    if "layer_types" in raw:
        mapped = _layer_types(raw["layer_types"], n_layers)
    else:
        pattern = _int(raw, "sliding_window_pattern", minimum=1)  # every pattern-th layer is full
        mapped = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    heads = _int(raw, "num_attention_heads", minimum=1)
    if "head_dim" in raw:
        head_dim = _int(raw, "head_dim", minimum=1)
    else:
        hidden = _int(raw, "hidden_size", minimum=1)
        head_dim = hidden // heads
        if head_dim < 1:
            raise ModelConfigError(
                f"config.json: hidden_size {hidden} / num_attention_heads {heads} gives a head "
                "dimension of 0: set head_dim"
            )
    return HybridSWAConfig(
        name=name,
        layer_types=mapped,
        window_tokens=_int(raw, "sliding_window", minimum=1),
        num_key_value_heads=_int(raw, "num_key_value_heads", heads, minimum=1),
        head_dim=head_dim,
        v_head_dim=head_dim,
        kv_dtype="bf16",
        weights=_weights_from_hf(raw),
        max_position_embeddings=_int(raw, "max_position_embeddings", 8192, minimum=1),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0),
    )


def _layer_types(types: object, n_layers: int) -> tuple[LayerType, ...]:
    """HF `layer_types` ("sliding_attention", "full_attention", ...) -> "sliding" | "full"."""
    if not isinstance(types, list):
        raise ModelConfigError("config.json field 'layer_types' must be a list")
    if len(types) != n_layers:
        raise ModelConfigError(
            f"config.json field 'layer_types' has {len(types)} entries but num_hidden_layers "
            f"is {n_layers}"
        )
    mapped: list[LayerType] = []
    for i, t in enumerate(types):
        if isinstance(t, str) and "sliding" in t:
            mapped.append("sliding")
        elif isinstance(t, str) and "full" in t:
            mapped.append("full")
        else:
            raise ModelConfigError(
                f"config.json field 'layer_types[{i}]' must name sliding or full attention "
                f"(e.g. 'sliding_attention', 'full_attention'), got {t!r}"
            )
    return tuple(mapped)
