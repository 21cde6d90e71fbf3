"""`dsv4 render`: every object the operator would apply for a DSV4Deployment, as a YAML stream.

GitOps users render and commit the result; tests and e2e use it too. Pure apart from reading
the input file. A spec the operator would refuse (invalid, unplannable, or a context that does
not fit) raises instead of rendering. Without `metadata.uid` (a file never applied) the
objects carry no owner references.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator.labels import API_VERSION, KIND
from dsv4_operator.modelsource import model_from_text
from dsv4_operator.objects import DesiredState, build_desired_state
from dsv4_operator.workloads import DEFAULT_WORKER_IMAGE


def desired_state_for(
    body: Mapping[str, Any],
    *,
    namespace: str | None = None,
    default_image: str = DEFAULT_WORKER_IMAGE,
    model_config: str | None = None,
) -> DesiredState:
    """Parse, plan and build; raises SpecError / MemoryPlanError naming the field.
    `model_config`: the config.json text a `spec.model.configMapRef` or `configPath` names
    (no cluster here: neither can be read)."""
    if body.get("apiVersion") != API_VERSION or body.get("kind") != KIND:
        raise SpecError(
            [
                f"apiVersion/kind: expected {API_VERSION} {KIND}, got "
                f"{body.get('apiVersion')} {body.get('kind')}"
            ]
        )
    declared = (body.get("metadata") or {}).get("namespace")
    if namespace and declared and declared != namespace:
        raise SpecError(
            [f"metadata.namespace: {declared!r} differs from --namespace {namespace!r}"]
        )
    spec = parse_spec(body)
    meta = parse_meta(body, default_namespace=namespace or "default")
    if model_config is not None and spec.model.preset is not None:
        raise SpecError(
            ["--model-config: the spec names a preset (model.preset), not a config.json"]
        )
    model = model_from_text(spec, model_config) if model_config is not None else None
    memory = plan_memory(spec, model.config if model else None)  # a configMapRef needs `model`
    if not memory.context_fits:
        raise SpecError([f"spec.maxContextTokens: {memory.context_message()}"])
    return build_desired_state(
        spec,
        meta,
        memory,
        default_image=default_image,
        model_config_hash=model.config_hash if model else None,
    )


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's JSON documents) as readable literal blocks; no
    anchors or aliases where objects share a sub-map (plain manifests for every GitOps tool)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def render(
    body: Mapping[str, Any],
    *,
    namespace: str | None = None,
    default_image: str = DEFAULT_WORKER_IMAGE,
    model_config: str | None = None,
) -> str:
    state = desired_state_for(
        body, namespace=namespace, default_image=default_image, model_config=model_config
    )
    return yaml.dump_all(state.objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)


def render_file(
    path: Path, *, namespace: str | None = None, model_config: str | None = None
) -> str:
    """Render every DSV4Deployment document of a YAML file (other documents are skipped)."""
    with path.open() as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    bodies = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == KIND]
    if not bodies:
        raise SpecError([f"{path}: no {KIND} document"])
    return "".join(render(b, namespace=namespace, model_config=model_config) for b in bodies)
