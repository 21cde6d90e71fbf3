"""`spec.model.servedModelNames` end to end under `dsv4 up`: the names reach every worker
through its rank config, and the router's /v1/models and its `model` check (both answered by
a decode worker) agree with them: a listed name is served, any other is a 404
`model_not_found`, on completions and chat alike."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from faultkit import Deployment

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[2] / "crds" / "samples" / "tiny-pd.yaml"
NAMES = ["tiny-chat", "tiny"]


def call(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request("GET" if body is None else "POST", path, body=data)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_the_crs_served_names_are_what_the_router_serves(tmp_path: Path) -> None:
    cr = yaml.safe_load(SAMPLE.read_text())
    cr["spec"]["model"]["servedModelNames"] = NAMES
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(cr))
    with Deployment.start(tmp_path / "cr.yaml", tmp_path / "work") as dep:
        api = dep.api_url
        for role in ("prefill", "decode"):
            config = json.loads(
                (tmp_path / "work" / f"{role}-0" / f"{role}-rank-0.json").read_text()
            )
            assert config["model"]["served_model_names"] == NAMES

        status, models = call(api, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == NAMES
        prompt = {"prompt": "This License", "max_tokens": 2, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for path, body in (("/v1/completions", prompt), ("/v1/chat/completions", chat)):
            status, answer = call(api, path, {**body, "model": "tiny-chat"})
            assert status == 200 and answer["model"] == "tiny-chat", answer
            status, answer = call(api, path, body)  # no model: the first name
            assert status == 200 and answer["model"] == "tiny-chat", answer
            status, answer = call(api, path, {**body, "model": "tiny-pd"})
            assert status == 404 and answer["error"]["code"] == "model_not_found", answer
