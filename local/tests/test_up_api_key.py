"""`dsv4 up` and an API key: a CR naming `spec.apiKey.secretRef` needs the key from
--api-key-file or $DSV4_API_KEY (no Secret can be read here), refused naming both; the key is
written once (mode 0600) and every rank and router config names it; end to end, the router and
the workers want it on their APIs, the probes stay open and `--request` sends it."""

from __future__ import annotations

import http.client
import json
import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from faultkit import Deployment

import dsv4_local.up
from dsv4_cli.main import main
from dsv4_local.plan import LaunchPlan

KEY = "sk-up-test-5"
SAMPLE = Path(__file__).resolve().parents[2] / "crds" / "samples" / "tiny-pd.yaml"
KEYED = {"secretRef": {"name": "tiny-key"}}


def cr(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny"},
        "spec": {"model": {"preset": "tiny"}, "maxContextTokens": 2048, **spec},
    }


def up_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, *flags: str) -> str:
    """`dsv4 up` on `text`: exit 2, nothing made, one error line (returned without prefix)."""
    file = tmp_path / "cr.yaml"
    file.write_text(text)
    workdir = tmp_path / "work"
    assert main(["up", str(file), "--workdir", str(workdir), *flags]) == 2
    assert not workdir.exists()
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    return lines[0].removeprefix("dsv4 up: error: ")


class Launched:
    """`launch`'s stand-in: records the plan (no process starts)."""

    def __init__(self) -> None:
        self.calls: list[tuple[LaunchPlan, dict[str, Any]]] = []

    def __call__(self, plan: LaunchPlan, **kwargs: Any) -> int:
        self.calls.append((plan, kwargs))
        return 0


def test_a_cr_naming_a_secret_needs_the_key_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSV4_API_KEY", raising=False)
    line = up_error(tmp_path, capsys, yaml.safe_dump(cr(apiKey=KEYED)))
    assert line.startswith("spec.apiKey.secretRef: dsv4 up cannot read Secret 'tiny-key'")
    assert "--api-key-file FILE or $DSV4_API_KEY" in line
    monkeypatch.setenv("DSV4_API_KEY", "two words")
    line = up_error(tmp_path, capsys, yaml.safe_dump(cr(apiKey=KEYED)))
    assert line.startswith("DSV4_API_KEY: the API key must be printable ASCII")
    monkeypatch.delenv("DSV4_API_KEY")
    line = up_error(
        tmp_path, capsys, yaml.safe_dump(cr()), "--api-key-file", str(tmp_path / "none")
    )
    assert line.startswith("--api-key-file: cannot read")


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_key_is_written_once_and_every_config_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    launched = Launched()
    monkeypatch.setattr(dsv4_local.up, "launch", launched)
    monkeypatch.delenv("DSV4_API_KEY", raising=False)
    flags: list[str] = []
    if source == "env":
        monkeypatch.setenv("DSV4_API_KEY", KEY)
    else:
        (tmp_path / "key").write_text(f"{KEY}\n")
        flags = ["--api-key-file", str(tmp_path / "key")]
    file = tmp_path / "cr.yaml"
    file.write_text(yaml.safe_dump(cr(apiKey=KEYED)))
    workdir = tmp_path / "work"
    assert main(["up", str(file), "--port", "0", "--workdir", str(workdir), *flags]) == 0
    ((plan, _),) = launched.calls
    assert plan.api_key == KEY.encode()
    assert plan.api_key_path.read_text() == f"{KEY}\n"
    assert stat.S_IMODE(os.stat(plan.api_key_path).st_mode) == 0o600
    assert len(plan.documents) == 3
    for document in plan.documents.values():
        assert document["api_key_file"] == str(plan.api_key_path)


def _call(url: str, path: str, key: str | None, body: dict[str, Any] | None = None) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request("GET" if body is None else "POST", path, body=data, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.slow
def test_every_api_of_a_keyed_deployment_wants_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = yaml.safe_load(SAMPLE.read_text())
    body["spec"]["apiKey"] = KEYED
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(body))
    monkeypatch.setenv("DSV4_API_KEY", KEY)  # `dsv4 up` inherits it
    prompt = {"prompt": "This License", "max_tokens": 2, "temperature": 0}
    with Deployment.start(tmp_path / "cr.yaml", tmp_path / "work") as dep:
        assert "api key: every API wants it" in dep.out()
        router = dep.api_url
        assert _call(router, "/v1/completions", None, prompt) == 401
        assert _call(router, "/v1/completions", "sk-wrong", prompt) == 401
        assert _call(router, "/v1/completions", KEY, prompt) == 200
        assert _call(router, "/v1/models", KEY) == 200
        assert _call(router, "/ready", None) == 200
        decode = dep.url("api", "decode-0")
        assert _call(decode, "/v1/completions", None, prompt) == 401
        for name in ("router", "decode-0", "prefill-0"):  # a deployed status port: open
            status_url = dep.url("status", name).removesuffix("/status")
            assert _call(status_url, "/status", None) == 200, name
            assert _call(status_url, "/metrics", None) == 200, name
