"""`spec.model.configMapRef` in the operator: the ConfigMap is read from the CR's namespace
(`modelsource`), mounted into worker pods only (that key, read-only, where the rank config
points), hashed into the worker templates, and re-read on every reconcile; `dsv4 render` takes
the file instead. The live scenario is test_operator_configmap.py."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kopf
import kubernetes_validate
import pytest
import yaml
from model_samples import tiny_hf_config
from repo_paths import MODEL_DATA, SAMPLES
from support.chart_support import needs_helm, render
from support.fake_kube import FakeKube, FakeProbe

from dsv4_cli.main import main
from dsv4_common.api.deployment import MemoryPlanError, plan_memory
from dsv4_common.api.rank_config import parse_rank_config
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_common.core.presets import deepseek_v4_flash
from dsv4_operator import labels as L
from dsv4_operator import main as operator_main
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.handlers import Deps, run_reconcile
from dsv4_operator.kube import KubeError
from dsv4_operator.modelsource import (
    config_map_index,
    config_text_hash,
    model_from_text,
    resolve_model,
)
from dsv4_operator.objects import DesiredState, build_desired_state
from dsv4_operator.reconcile import ReconcileResult, reconcile
from dsv4_operator.render import render as render_cr

NS = "ns"  # conftest's make_body
CM = "tiny-model"
REF_FIELD = "spec.model.configMapRef"
GPU = {"type": "h100-80gb", "perPod": 1}
Body = dict[str, Any]
LOG = logging.getLogger("test")


@pytest.fixture
def body(make_body: Callable[..., Body]) -> Body:
    return make_body(model={"configMapRef": {"name": CM, "key": "config.json"}}, gpu=GPU)


def config_map(text: str | None = None, **fields: Any) -> Body:
    data = {"config.json": text if text is not None else tiny_hf_config()}
    meta = {"name": CM, "namespace": NS}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data, **fields}


def put(kube: FakeKube, obj: Body) -> None:
    """A user's ConfigMap, created or edited (not a write of the operator's)."""
    kube.objects[("v1", "ConfigMap", NS, obj["metadata"]["name"])] = obj


def run(kube: FakeKube) -> ReconcileResult:
    return reconcile(kube.cr, kube, FakeProbe())


def plan_valid(kube: FakeKube) -> dict[str, Any]:
    return next(c for c in kube.cr["status"]["conditions"] if c["type"] == "PlanValid")


def desired(body: Body, text: str | None = None) -> DesiredState:
    spec = parse_spec(body)
    model = model_from_text(spec, text if text is not None else tiny_hf_config())
    memory = plan_memory(spec, model.config)
    return build_desired_state(spec, parse_meta(body), memory, model_config_hash=model.config_hash)


def templates(state: DesiredState) -> dict[str, Body]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in state.objects
        if o["kind"] in ("StatefulSet", "Deployment")
    }


# --- reading the ConfigMap ---------------------------------------------------------------------


class GetFails:
    """A Kube whose get fails with `status`."""

    def __init__(self, status: int, retryable: bool) -> None:
        self.error = KubeError(f"get: {status}", retryable=retryable, status=status)

    def get(self, *_: Any) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("stored", "needle"),
    [
        (None, f"ConfigMap {NS}/{CM} not found; create it"),
        (config_map(data={"other.json": "{}"}), "key 'config.json' missing (its keys: other.json)"),
        (
            config_map(data={}, binaryData={"config.json": "e30="}),
            "key 'config.json' is binaryData: store config.json as text data",
        ),
        (config_map("{"), "not valid JSON"),
    ],
    ids=["missing", "no-key", "binary", "bad-json"],
)
def test_each_config_map_problem_names_the_field(
    body: Body, stored: Body | None, needle: str
) -> None:
    kube = FakeKube(body)
    if stored is not None:
        put(kube, stored)
    with pytest.raises(MemoryPlanError, match=rf"^{REF_FIELD}") as info:
        resolve_model(parse_spec(body), NS, kube)
    assert needle in str(info.value)


def test_a_forbidden_read_is_a_plan_problem_a_server_error_is_retried(body: Body) -> None:
    spec = parse_spec(body)
    with pytest.raises(MemoryPlanError, match=rf"^{REF_FIELD}: cannot read .*needs get"):
        resolve_model(spec, NS, GetFails(403, retryable=False))  # type: ignore[arg-type]
    with pytest.raises(KubeError):
        resolve_model(spec, NS, GetFails(503, retryable=True))  # type: ignore[arg-type]


def test_the_config_map_is_read_only_from_the_crs_namespace(body: Body) -> None:
    kube = FakeKube(body)
    put(kube, config_map())
    assert resolve_model(parse_spec(body), NS, kube).config_hash == config_text_hash(
        tiny_hf_config()
    )
    with pytest.raises(MemoryPlanError, match="not found"):
        resolve_model(parse_spec(body), "other", kube)


def test_a_preset_is_not_read_from_the_cluster(make_body: Callable[..., Body]) -> None:
    body = make_body()
    resolved = resolve_model(parse_spec(body), NS, GetFails(500, True))  # type: ignore[arg-type]
    assert resolved.config.name == "tiny" and resolved.config_hash is None


def test_index_maps_the_config_map_to_its_referrers() -> None:
    spec = {"model": {"configMapRef": {"name": CM}}}
    assert config_map_index(NS, "a", spec) == {(NS, CM): "a"}
    assert config_map_index(NS, "a", {"model": {"preset": "tiny"}}) == {}
    assert config_map_index(NS, "a", {"model": "junk"}) == {}
    assert config_map_index(None, "a", spec) == {}


# --- what the workers get --------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_every_object_passes_strict_schema_validation(body: Body, version: str) -> None:
    for obj in desired(body).objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_workers_mount_only_that_key_read_only_where_their_rank_config_points(
    body: Body,
) -> None:
    state = desired(body)
    cm = next(o for o in state.objects if o["kind"] == "ConfigMap")
    for name, template in templates(state).items():
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        if name == "tiny-router":
            assert "model-config" not in volumes and "model-config" not in mounts
            continue
        assert volumes["model-config"]["configMap"] == {
            "name": CM,
            "items": [{"key": "config.json", "path": f"{CM}/config.json"}],
        }
        mount = mounts["model-config"]
        assert mount["readOnly"] is True
        assert pod["automountServiceAccountToken"] is False  # a mount, never the API
        labels = template["metadata"]["labels"]
        key = f"{labels[L.ROLE_LABEL]}-rank-0.json"
        model = parse_rank_config(json.loads(cm["data"][key])).model
        assert model.preset is None
        assert model.config_path == f"{mount['mountPath']}/{CM}/config.json"
        hash_ = template["metadata"]["annotations"][L.MODEL_CONFIG_HASH_ANNOTATION]
        assert hash_ == config_text_hash(tiny_hf_config())


def test_a_user_volume_may_not_take_the_model_config_name(body: Body) -> None:
    body["spec"]["decode"]["podTemplate"] = {
        "spec": {"volumes": [{"name": "model-config", "emptyDir": {}}]}
    }
    with pytest.raises(
        SpecError, match=r"spec\.decode\.podTemplate\.spec\.volumes\[model-config\]"
    ):
        desired(body)


def test_any_edit_of_the_config_text_rolls_every_worker_but_not_the_router(body: Body) -> None:
    base = desired(body).template_hashes
    # Same plan (a key the planner ignores), new text: the workers still roll.
    extra = json.dumps({**json.loads(tiny_hf_config()), "eos_token_id": 1})
    for text in (extra, tiny_hf_config(num_hidden_layers=4)):
        changed = desired(body, text).template_hashes
        assert changed["tiny-router"] == base["tiny-router"]
        workers = [g for g in base if g != "tiny-router"]
        assert workers and all(changed[g] != base[g] for g in workers)


# --- reconcile ---------------------------------------------------------------------------------


def test_a_missing_config_map_fails_the_plan_applies_nothing_and_is_retried(body: Body) -> None:
    kube = FakeKube(body)
    result = run(kube)
    assert result.problem is not None and result.problem.reason == "PlanFailed"
    assert result.problem.message.startswith(f"{REF_FIELD}: ConfigMap {NS}/{CM} not found")
    assert not result.permanent  # the ConfigMap may appear: the timer and its event retry
    assert kube.writes == [("patch_status", "tiny")]
    cond = plan_valid(kube)
    assert (cond["status"], cond["reason"]) == ("False", "PlanFailed")
    assert REF_FIELD in cond["message"]
    deps = Deps(kube, FakeProbe(), OperatorConfig(), ReconcileGate())
    run_reconcile(kube.cr, deps, LOG)  # no kopf.PermanentError: kopf keeps retrying


def test_the_config_map_model_is_planned_and_an_edit_replans(body: Body) -> None:
    kube = FakeKube(body)
    put(kube, config_map(tiny_hf_config(num_hidden_layers=6)))
    run(kube)
    assert plan_valid(kube)["status"] == "True"
    before = kube.cr["status"]["plan"]
    assert max(p["layers"][1] for p in before) == 6
    sts = kube.of_kind("StatefulSet")
    hashes = {n: s["spec"]["template"]["metadata"]["annotations"] for n, s in sts.items()}
    router = kube.of_kind("Deployment")["tiny-router"]["spec"]["template"]["metadata"]

    put(kube, config_map(tiny_hf_config(num_hidden_layers=4)))
    mark = len(kube.writes)
    run(kube)
    after = kube.cr["status"]["plan"]
    assert after != before and max(p["layers"][1] for p in after) == 4
    for name, s in kube.of_kind("StatefulSet").items():
        annotations = s["spec"]["template"]["metadata"]["annotations"]
        for key in (L.TEMPLATE_HASH_ANNOTATION, L.MODEL_CONFIG_HASH_ANNOTATION):
            assert annotations[key] != hashes[name][key], (name, key)
    assert kube.of_kind("Deployment")["tiny-router"]["spec"]["template"]["metadata"] == router
    applied = {w[1:] for w in kube.writes_since(mark) if w[0] == "apply"}
    assert applied == {("ConfigMap", "tiny-config")} | {("StatefulSet", n) for n in sts}


@pytest.mark.parametrize("form", ["", "-transformers"], ids=["release", "transformers"])
def test_the_flash_sample_plans_from_the_published_config_json(
    make_body: Callable[..., Body], form: str
) -> None:
    """crds/samples/flash-configmap.yaml with DeepSeek-V4-Flash's own config.json (as released
    or as transformers writes it) in its ConfigMap: planned like the preset."""
    sample = make_body("flash-configmap.yaml")
    ref = sample["spec"]["model"]["configMapRef"]
    text = (MODEL_DATA / f"deepseek-v4-flash{form}" / "config.json").read_text()
    kube = FakeKube(sample)
    put(kube, {**config_map(text), "metadata": {"name": ref["name"], "namespace": NS}})
    run(kube)
    assert plan_valid(kube)["status"] == "True", plan_valid(kube)
    spec = parse_spec(sample)
    model = dataclasses.replace(model_from_text(spec, text).config, name="deepseek-v4-flash")
    assert plan_memory(spec, model) == plan_memory(spec, deepseek_v4_flash())


def test_a_deleted_config_map_leaves_the_running_workers_alone(body: Body) -> None:
    kube = FakeKube(body)
    put(kube, config_map())
    run(kube)
    kube.objects.pop(("v1", "ConfigMap", NS, CM))
    mark = len(kube.writes)
    result = run(kube)
    assert result.problem is not None and "not found" in result.problem.message
    assert kube.writes_since(mark) == [("patch_status", "tiny")]
    assert set(kube.of_kind("StatefulSet")) == {"tiny-prefill-0", "tiny-decode-0"}


# --- kopf: the watch, and what it needs ----------------------------------------------------------


def _watched() -> set[tuple[str, str]]:
    registry = kopf.get_default_registry()
    assert operator_main.handlers  # registered by importing the module
    return {
        (s.group or "", s.any_name or s.plural or "")
        for part in (registry._watching, registry._indexing, registry._changing)
        for s in part.get_all_selectors()
    }


def test_config_maps_are_watched_and_deployments_indexed_by_their_config_map() -> None:
    registry = kopf.get_default_registry()
    assert ("", "configmaps") in _watched()
    indexed = {s.any_name for s in registry._indexing.get_all_selectors()}
    assert indexed == {L.PLURAL}


@needs_helm
@pytest.mark.parametrize("values", [[], ["--set", "rbac.namespaced=true"]], ids=["cluster", "ns"])
def test_the_chart_grants_what_every_watch_and_the_config_map_read_need(values: list[str]) -> None:
    objects = render(*values)
    roles = [
        o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
        and any(r["resources"] == ["dsv4deployments"] for r in o["rules"])
    ]
    assert roles
    for role in roles:
        grants: dict[tuple[str, str], set[str]] = {}
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    grants.setdefault((group, res), set()).update(rule["verbs"])
        for resource in _watched():  # kopf lists and watches (it gets none of them)
            assert {"list", "watch"} <= grants.get(resource, set()), resource
        assert "get" in grants[("", "configmaps")]  # the configMapRef's read


# --- dsv4 render: no cluster -------------------------------------------------------------------


def test_render_without_the_config_names_the_field_and_with_it_matches_the_operator(
    body: Body,
) -> None:
    with pytest.raises(MemoryPlanError, match=rf"^{REF_FIELD}: .*--model-config"):
        render_cr(body)
    docs = list(yaml.safe_load_all(render_cr(body, model_config=tiny_hf_config())))
    assert docs == list(desired(body).objects)


def test_cli_render_takes_the_config_as_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = str(SAMPLES / "flash-configmap.yaml")
    assert main(["render", sample]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 render: error: spec.model.configMapRef: ")
    assert "--model-config" in err
    config = MODEL_DATA / "deepseek-v4-flash" / "config.json"  # the published file
    assert main(["render", sample, "--model-config", str(config)]) == 0
    docs: list[Mapping[str, Any]] = list(yaml.safe_load_all(capsys.readouterr().out))
    volumes = [
        v
        for d in docs
        if d["kind"] == "StatefulSet"
        for v in d["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "model-config"
    ]
    assert volumes and all(v["configMap"]["name"] == "dsv4-flash-config" for v in volumes)
    assert main(["render", str(SAMPLES / "tiny-cpu.yaml"), "--model-config", str(config)]) == 2
    assert "--model-config: the spec names a preset (model.preset)" in capsys.readouterr().err
    assert main(["render", sample, "--model-config", str(tmp_path / "absent.json")]) == 2
    assert "--model-config" in capsys.readouterr().err
