"""The model a DSV4Deployment plans for: a preset, a `configPath` (read from the operator's own
filesystem) or a `spec.model.configMapRef`, read through the API from the CR's own namespace.

Pure apart from the `Kube` port it is handed. Every problem is a `MemoryPlanError` whose message
names `spec.model.configMapRef` (or the preset/configPath field); none needs a spec edit to go
away (the ConfigMap may be created or fixed later), so the reconciler reports it and retries.
The admission webhook may call `resolve_model` too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_common.api.deployment import (
    CONFIG_MAP_REF_FIELD,
    MemoryPlanError,
    load_model,
    model_from_config_map,
    model_from_config_path_text,
    model_from_config_text,
)
from dsv4_common.api.spec import ConfigMapRef, DeploymentSpec
from dsv4_common.core.model import ModelConfig
from dsv4_operator.kube import Kube, KubeError

__all__ = ["ResolvedModel", "config_map_index", "model_from_text", "resolve_model"]


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    config: ModelConfig
    # A hash of the configMapRef's config.json text (None for a preset or configPath). Worker
    # pods carry it, so any edit of that text, even one the plan ignores, rolls them.
    config_hash: str | None = None


def resolve_model(
    spec: DeploymentSpec, namespace: str, kube: Kube, origin_config: str | None = None
) -> ResolvedModel:
    """The model of `spec`, whose CR lives in `namespace`. `origin_config`: the config.json text
    an hf:// source brought (read from the hub by the caller). Raises MemoryPlanError naming the
    field; a retryable API error (KubeError) propagates for the caller to retry."""
    ref = spec.model.config_map
    hf = spec.model.hf
    if hf is not None and spec.model.config_from_origin and origin_config is not None:
        return ResolvedModel(
            model_from_config_text(spec, origin_config, name=hf.repo_id.rsplit("/", 1)[-1])
        )
    if ref is None:
        return ResolvedModel(load_model(spec))
    return model_from_text(spec, _read_key(kube, namespace, ref))


def model_from_text(
    spec: DeploymentSpec, text: str, where: str = "--model-config"
) -> ResolvedModel:
    """The configMapRef's model from the config.json text its ConfigMap holds (or a file's:
    `dsv4 render --model-config`); for a configPath (a path on the operator's filesystem), the
    text of that file, as the operator would read it there (no hash: it reads the path)."""
    if spec.model.config_path is not None:
        return ResolvedModel(model_from_config_path_text(spec, text, where))
    return ResolvedModel(model_from_config_map(spec, text), config_text_hash(text))


def config_text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_map_index(
    namespace: str | None, name: str | None, spec: Mapping[str, Any]
) -> dict[tuple[str, str], str]:
    """A DSV4Deployment's entry in the index of ConfigMaps by referrer: (namespace, ConfigMap
    name) -> the CR's name; empty when it names none (an empty result also drops a stale
    entry from kopf's index, where None would keep it)."""
    model = spec.get("model")
    ref = model.get("configMapRef") if isinstance(model, Mapping) else None
    cm_name = ref.get("name") if isinstance(ref, Mapping) else None
    if not (namespace and name and isinstance(cm_name, str)):
        return {}
    return {(namespace, cm_name): name}


def _read_key(kube: Kube, namespace: str, ref: ConfigMapRef) -> str:
    where = f"ConfigMap {namespace}/{ref.name}"
    try:
        config_map = kube.get("v1", "ConfigMap", namespace, ref.name)
    except KubeError as exc:
        if exc.retryable:
            raise
        raise MemoryPlanError(
            f"{CONFIG_MAP_REF_FIELD}: cannot read {where}: {exc} (the operator needs get on "
            "configmaps in the namespaces it serves)"
        ) from exc
    if config_map is None:
        raise MemoryPlanError(
            f"{CONFIG_MAP_REF_FIELD}: {where} not found; create it from the model's config.json: "
            f"kubectl -n {namespace} create configmap {ref.name} --from-file={ref.key}=config.json"
        )
    data = config_map.get("data") or {}
    text = data.get(ref.key)
    if not isinstance(text, str):
        binary = config_map.get("binaryData") or {}
        keys = ", ".join(sorted({*data, *binary})) or "none"
        why = "is binaryData: store config.json as text data" if ref.key in binary else "missing"
        raise MemoryPlanError(
            f"{CONFIG_MAP_REF_FIELD}.key: {where} key {ref.key!r} {why} (its keys: {keys})"
        )
    return text
