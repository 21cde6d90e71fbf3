"""The one DSV4Deployment of a `dsv4 up` file: parsed, validated and memory-planned exactly as
`dsv4 render` and the operator do (the shared `dsv4_common.api` functions), plus what `dsv4 up`
itself cannot run (engine sglang). Pure: YAML text in, `Deployment` out; every error is a
`SpecError` or a `MemoryPlanError` whose message names the field to change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from dsv4_common.api.deployment import MemoryPlan, plan_memory
from dsv4_common.api.model_files import ModelFiles, spec_model_files
from dsv4_common.api.model_source import PvcSource
from dsv4_common.api.names import API_VERSION, KIND
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, SpecError, parse_meta, parse_spec
from dsv4_common.core.model import ModelConfig

# The model an hf:// source brings (its config.json, fetched before any weight moves); None:
# the spec's preset, configPath or local path.
ModelFor = Callable[[DeploymentSpec], ModelConfig | None]

__all__ = ["Deployment", "device_problem", "parse_deployment"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A valid CR whose context fits its memory plan."""

    spec: DeploymentSpec
    meta: DeploymentMeta
    memory: MemoryPlan
    # Where the workers find the model's files (an hf:// source's: set once it is fetched).
    files: ModelFiles | None = None


def parse_deployment(text: str, source: str, model_for: ModelFor | None = None) -> Deployment:
    """The single DSV4Deployment document of `text` (`source` names the file in errors).
    `model_for(spec)`: the model of an hf:// source (`dsv4_local.weights`).

    Raises yaml.YAMLError, SpecError or MemoryPlanError; other kinds of document are skipped,
    as `dsv4 render` skips them.
    """
    bodies = [
        d for d in yaml.safe_load_all(text) if isinstance(d, Mapping) and d.get("kind") == KIND
    ]
    if len(bodies) != 1:
        found = "no" if not bodies else str(len(bodies))
        raise SpecError([f"{source}: {found} {KIND} documents; dsv4 up runs exactly one"])
    body: Mapping[str, Any] = bodies[0]
    if body.get("apiVersion") != API_VERSION:
        raise SpecError([f"apiVersion: expected {API_VERSION}, got {body.get('apiVersion')}"])
    spec = parse_spec(body)
    if spec.engine.sglang:
        raise SpecError(
            [
                "spec.engine.name: dsv4 up runs only our engine (dsv4), not sglang; run an "
                "sglang CR in a cluster (dsv4 render shows what the operator applies)"
            ]
        )
    if isinstance(spec.model.origin, PvcSource):
        raise SpecError(
            [
                "spec.model.source: pvc:// names a cluster's claim; dsv4 up reads hf://ORG/NAME "
                "(into the local Hugging Face cache) or a local path"
            ]
        )
    meta = parse_meta(body)
    memory = plan_memory(spec, model_for(spec) if model_for is not None else None)
    if not memory.context_fits:
        raise SpecError([f"spec.maxContextTokens: {memory.context_message()}"])
    files = None if spec.model.hf is not None else spec_model_files(spec)
    return Deployment(spec=spec, meta=meta, memory=memory, files=files)


def device_problem(spec: DeploymentSpec, missing: str) -> str:
    """The refusal of a GPU deployment (not CPU mode) on a machine without a CUDA device
    (`missing` says why it has none), naming the field and the fix."""
    gpu = spec.gpu
    what = f"gpu.type {gpu.type}" if gpu.type else f"gpu.memoryGiB {gpu.memory_gib:g}"
    return (
        f"spec.gpu: this sample needs a GPU ({what}, {gpu.per_pod} per pod) and this machine "
        f"has none ({missing}); on CPU use a CPU-mode sample, crds/samples/tiny-*.yaml "
        "(e.g. dsv4 up crds/samples/tiny-pd.yaml)"
    )
