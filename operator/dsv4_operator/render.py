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

from dsv4_common.api.deployment import model_from_config_text, plan_memory
from dsv4_common.api.model_files import with_hf_weights
from dsv4_common.api.model_source import is_commit
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator.labels import API_VERSION, KIND
from dsv4_operator.modelsource import ResolvedModel, model_from_text
from dsv4_operator.objects import DesiredState, build_desired_state
from dsv4_operator.weights import Resolved, target_of
from dsv4_operator.workloads import DEFAULT_WORKER_IMAGE


def desired_state_for(
    body: Mapping[str, Any],
    *,
    namespace: str | None = None,
    default_image: str = DEFAULT_WORKER_IMAGE,
    model_config: str | None = None,
    revision: str | None = None,
) -> DesiredState:
    """Parse, plan and build; raises SpecError / MemoryPlanError naming the field.
    `model_config`: the config.json text a `spec.model.configMapRef` or `configPath` names,
    or an hf:// source brings (no cluster, no hub here); `revision`: the commit an hf:// source
    resolves to (else the one it names). An hf:// source's shared download objects (claim, Job)
    are not rendered: they depend on the hub's file list (docs/operator.md, Weights)."""
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
    hf = spec.model.hf
    from_hub = hf is not None and spec.model.config_from_origin
    named = spec.model.config_map is not None or spec.model.config_path is not None
    if model_config is not None and not named and not from_hub:
        raise SpecError(
            [
                "--model-config: the spec names no model.configMapRef or configPath (nor an "
                "hf:// source's own config.json)"
            ]
        )
    model = None
    if model_config is not None and hf is not None and from_hub:
        name = hf.repo_id.rsplit("/", 1)[-1]
        model = ResolvedModel(model_from_config_text(spec, model_config, name=name))
    elif model_config is not None:
        model = model_from_text(spec, model_config)
    memory = plan_memory(spec, model.config if model else None)  # a configMapRef needs `model`
    if not memory.context_fits:
        raise SpecError([f"spec.maxContextTokens: {memory.context_message()}"])
    if hf is not None:
        commit = revision or (hf.revision if hf.pinned else None)
        if commit is None or not is_commit(commit):
            raise SpecError(
                [
                    f"spec.model.source: {hf.uri} is resolved to a commit by the operator; "
                    "render with --revision COMMIT (40 hex digits), or name the commit in the "
                    "source"
                ]
            )
        claim = target_of(spec, Resolved(hf, commit, 0, 0, None)).claim
        spec = with_hf_weights(spec, claim, commit)
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
    revision: str | None = None,
) -> str:
    state = desired_state_for(
        body,
        namespace=namespace,
        default_image=default_image,
        model_config=model_config,
        revision=revision,
    )
    return yaml.dump_all(state.objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)


def render_file(
    path: Path,
    *,
    namespace: str | None = None,
    model_config: str | None = None,
    revision: str | None = None,
) -> str:
    """Render every DSV4Deployment document of a YAML file (other documents are skipped)."""
    with path.open() as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    bodies = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == KIND]
    if not bodies:
        raise SpecError([f"{path}: no {KIND} document"])
    return "".join(
        render(b, namespace=namespace, model_config=model_config, revision=revision) for b in bodies
    )
