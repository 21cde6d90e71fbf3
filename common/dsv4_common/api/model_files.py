"""Where a worker finds the model's files, once its source is resolved: a directory (the
snapshot of an hf:// source, a pvc:// claim's path, a local path, the older weights mount) and
whether the model's config.json is read from it (an hf:// or local source without a preset,
configPath or configMapRef). The operator computes it for the pods (a cache claim's mount), `dsv4
up` for local processes (the local cache); the rank config carries it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from dsv4_common.api.model_source import HfSource, LocalSource, PvcSource, snapshot_path
from dsv4_common.api.spec import DeploymentSpec

# Where worker pods mount a pvc:// claim (its PATH as the mount's subPath) and an hf:// source's
# cache claim (a Hugging Face cache: models--ORG--NAME/snapshots/COMMIT inside).
PVC_MOUNT_PATH: Final = "/var/lib/dsv4/weights"
HF_CACHE_MOUNT_PATH: Final = "/var/lib/dsv4/hf"


@dataclass(frozen=True, slots=True)
class ModelFiles:
    model_dir: str  # the checkpoint directory, as the worker sees it
    config_from_dir: bool = False  # config.json is the directory's (no other config source)
    served_name: str | None = None  # the default served name (an hf:// repo id); None: the dir's


def pod_model_files(spec: DeploymentSpec, commit: str | None) -> ModelFiles | None:
    """What worker pods see: None without weights (random ones); an hf:// source needs its
    resolved `commit`."""
    model = spec.model
    origin = model.origin
    if isinstance(origin, HfSource):
        assert commit is not None, "an hf:// source is resolved before its pods are rendered"
        return ModelFiles(
            snapshot_path(HF_CACHE_MOUNT_PATH, origin.repo_id, commit),
            config_from_dir=model.config_from_origin,
            served_name=origin.repo_id,
        )
    if isinstance(origin, PvcSource):
        return ModelFiles(PVC_MOUNT_PATH)
    if isinstance(origin, LocalSource):
        return ModelFiles(origin.path, config_from_dir=model.config_from_origin)
    if model.weights is not None:
        return ModelFiles(model.weights.path)
    return None
