"""`dsv4 render`: the YAML stream equals what the reconciler applies; errors name the field
and exit 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import SAMPLES

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
