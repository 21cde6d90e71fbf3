"""Where a worker finds the model's files once its source is resolved, and whether config.json
is read from there (an hf:// or local source without a preset, configPath or configMapRef).

- In a cluster, worker pods mount a claim: `model.weights` (as written, or a pvc:// source's),
  or an hf:// source's cache claim, which the operator fills in once it knows the commit
  (`with_hf_weights`); the rank config's paths follow from `spec.model.weights`.
- `dsv4 up` gives the rank configs a local directory instead (`ModelFiles`: a local source, or
  the local Hugging Face cache's snapshot of an hf:// source).
Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsv4_common.api.model_source import (
    HF_CACHE_MOUNT_PATH,
    HfSource,
    LocalSource,
    snapshot_path,
)
from dsv4_common.api.spec import DeploymentSpec, WeightsSpec


@dataclass(frozen=True, slots=True)
class ModelFiles:
    model_dir: str  # the checkpoint directory, as the worker sees it
    config_from_dir: bool = False  # config.json is the directory's (no other config source)
    served_name: str | None = None  # the default served name (an hf:// repo id); None: the dir's


def with_hf_weights(spec: DeploymentSpec, claim: str, commit: str) -> DeploymentSpec:
    """The spec whose worker pods mount the cache claim holding `commit` of its hf:// source."""
    hf = spec.model.hf
    assert hf is not None, "not an hf:// source"
    weights = WeightsSpec(
        claim,
        HF_CACHE_MOUNT_PATH,
        directory=snapshot_path(HF_CACHE_MOUNT_PATH, hf.repo_id, commit),
    )
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, weights=weights))


def spec_model_files(spec: DeploymentSpec) -> ModelFiles | None:
    """What the spec's weights mount (or local source) gives the workers; None: random weights
    (or an hf:// source not resolved yet)."""
    model = spec.model
    hf = model.hf
    if isinstance(model.origin, LocalSource):
        return ModelFiles(model.origin.path, config_from_dir=model.config_from_origin)
    if model.weights is None:
        return None
    return ModelFiles(
        model.weights.model_dir,
        config_from_dir=model.config_from_origin,
        served_name=hf.repo_id if isinstance(hf, HfSource) else None,
    )
