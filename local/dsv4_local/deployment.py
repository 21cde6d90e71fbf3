"""The one DSV4Deployment of a `dsv4 up` file: parsed, validated and memory-planned exactly as
`dsv4 render` and the operator do (the shared `dsv4_common.api` functions), plus what `dsv4 up`
itself cannot run (engine sglang). Pure: YAML text in, `Deployment` out; every error is a
`SpecError` or a `MemoryPlanError` whose message names the field to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from dsv4_common.api.deployment import MemoryPlan, plan_memory
from dsv4_common.api.names import API_VERSION, KIND
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, SpecError, parse_meta, parse_spec

__all__ = ["Deployment", "device_problem", "parse_deployment"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A valid CR whose context fits its memory plan."""

    spec: DeploymentSpec
    meta: DeploymentMeta
    memory: MemoryPlan


def parse_deployment(text: str, source: str) -> Deployment:
    """The single DSV4Deployment document of `text` (`source` names the file in errors).

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
    meta = parse_meta(body)
    memory = plan_memory(spec)
    if not memory.context_fits:
        raise SpecError([f"spec.maxContextTokens: {memory.context_message()}"])
    return Deployment(spec=spec, meta=meta, memory=memory)


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
