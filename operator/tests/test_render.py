"""`dsv4 render`: the YAML stream equals what the reconciler applies; errors name the field
and exit 2."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import MODEL_DATA, SAMPLES

from dsv4_cli.main import main
from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator.objects import build_desired_state
from dsv4_operator.render import render, render_file


def test_render_stream_is_the_desired_state(make_body: Callable[..., dict[str, Any]]) -> None:
    body = make_body()
    spec = parse_spec(body)
    state = build_desired_state(spec, parse_meta(body), plan_memory(spec))
    assert list(yaml.safe_load_all(render(body))) == list(state.objects)


def test_file_without_uid_renders_without_owner_references() -> None:
    docs = list(yaml.safe_load_all(render_file(SAMPLES / "tiny-cpu.yaml", namespace="demo")))
    assert docs and all("ownerReferences" not in d["metadata"] for d in docs)
    assert {d["metadata"]["namespace"] for d in docs} == {"demo"}


def test_context_that_does_not_fit_is_refused(make_body: Callable[..., dict[str, Any]]) -> None:
    with pytest.raises(SpecError, match=r"^spec\.maxContextTokens: .*largest context that fits"):
        render(make_body(maxContextTokens=8192))


def test_namespace_flag_must_agree_with_the_file(make_body: Callable[..., dict[str, Any]]) -> None:
    with pytest.raises(SpecError, match=r"metadata\.namespace"):
        render(make_body(), namespace="other")


def test_cli_render_prints_a_stream(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(SAMPLES / "tiny-cpu.yaml"), "--namespace", "demo"]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds.count("StatefulSet") == 2 and "Deployment" in kinds


@pytest.mark.parametrize(
    "path", sorted((SAMPLES / "invalid").glob("*.yaml"))[:6], ids=lambda p: p.name
)
def test_cli_render_names_the_field_and_exits_2(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expect = next(
        line.split(":", 1)[1].strip()
        for line in path.read_text().splitlines()
        if line.startswith("# expect:")
    )
    assert main(["render", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 render: error: ") and expect in err


def test_cli_render_of_a_missing_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "/nonexistent.yaml"]) == 2
    assert "No such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sample", ["tiny-cpu.yaml", "tiny-minimal.yaml", "flash-gpu.yaml", "flash-h200-volcano.yaml"]
)
def test_render_writes_plain_yaml_without_anchors(sample: str) -> None:
    """Objects share sub-maps (a selector reused in a NetworkPolicy rule); the stream must not
    turn them into YAML anchors and aliases, which some GitOps tools and reviewers trip on."""
    text = render_file(SAMPLES / sample, namespace="demo")
    assert not [line for line in text.splitlines() if "&id" in line or "*id" in line]
    assert list(yaml.safe_load_all(text))


# The config.json a sample's configMapRef or configPath (a cluster path) names, or its hf://
# source brings from the hub, as published.
SAMPLE_MODEL_CONFIGS = {
    "flash-configmap.yaml": MODEL_DATA / "deepseek-v4-flash" / "config.json",
    "pro-pd-pp.yaml": MODEL_DATA / "deepseek-v4-pro" / "config.json",
    "flash-hf.yaml": MODEL_DATA / "deepseek-v4-flash" / "config.json",
}
# An hf:// source names a branch: render (no hub) is told the commit it resolves to.
SAMPLE_REVISIONS = {"flash-hf.yaml": "0123456789abcdef0123456789abcdef01234567"}


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.glob("*.yaml")))
def test_every_sample_renders_locally_as_the_docs_say(
    sample: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsv4 render SAMPLE` (with `--model-config FILE` where the sample's config.json lives in
    the cluster or on the hub, and `--revision COMMIT` for an hf:// branch) exits 0; without
    the file such a sample says to give it."""
    path = str(SAMPLES / sample)
    extra = []
    if sample in SAMPLE_MODEL_CONFIGS:
        assert main(["render", path]) == 2
        assert "--model-config" in capsys.readouterr().err
        extra = ["--model-config", str(SAMPLE_MODEL_CONFIGS[sample])]
    if sample in SAMPLE_REVISIONS:
        extra += ["--revision", SAMPLE_REVISIONS[sample]]
    assert main(["render", path, *extra]) == 0, capsys.readouterr().err
    assert any(d["kind"] == "StatefulSet" for d in yaml.safe_load_all(capsys.readouterr().out))


def test_model_config_for_a_config_path_renders_as_the_file_at_that_path(tmp_path: Path) -> None:
    """`--model-config FILE` for `configPath: /models/DeepSeek-V4-Pro/config.json` renders what
    the operator renders with that file at that path (here: a copy in a directory of the same
    name), the path (and the hashes of what holds it) aside."""
    text = (MODEL_DATA / "deepseek-v4-pro" / "config.json").read_text()
    local = tmp_path / "DeepSeek-V4-Pro" / "config.json"
    local.parent.mkdir()
    local.write_text(text)
    body = yaml.safe_load((SAMPLES / "pro-pd-pp.yaml").read_text())
    cluster_path = body["spec"]["model"]["configPath"]
    from_file = render(body, namespace="demo", model_config=text)
    body["spec"]["model"]["configPath"] = str(local)
    at_the_path = render(body, namespace="demo")
    assert cluster_path in from_file and str(local) in at_the_path

    def unhashed(text: str) -> list[str]:  # the config hashes cover the path too
        return [line for line in text.splitlines() if not re.search(r"-hash: [0-9a-f]+$", line)]

    assert unhashed(from_file) == unhashed(at_the_path.replace(str(local), cluster_path))
