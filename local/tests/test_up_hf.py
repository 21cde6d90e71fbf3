"""`dsv4 serve --model hf://...` and `dsv4 up` with an hf:// `spec.model.source`, against the fake
hub: the model is fetched into the local Hugging Face cache (progress on stderr), planned from
its config.json, served under its repo id, and later served `--offline` with the hub gone. A
bad reference or a gated repo fails at once, naming the flag or field, before any worker starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import FakeHub
from hub_models import tiny_files
from serve_support import ENV, free_port, post, wait_ready

pytestmark = pytest.mark.slow
REPO = "acme/tiny"
CR = """\
apiVersion: serving.dsv4.io/v1alpha1
kind: DSV4Deployment
metadata:
  name: hf-tiny
spec:
  model:
    source: hf://{repo}
    hub:
      endpoint: {endpoint}
  maxContextTokens: 1024
  kv:
    pageSize: 16
    transfer: zmq
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "cache"), **extra)
    return env


def _serve(tmp_path: Path, port: int, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "dsv4_cli", "serve", "--port", str(port), *args]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out.decode()


def _models(port: int) -> list[str]:
    import http.client
    import json

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    return [m["id"] for m in json.loads(c.getresponse().read())["data"]]


def test_serve_fetches_an_hf_model_then_serves_it_offline(tmp_path: Path) -> None:
    with FakeHub(tmp_path / "hub") as hub:
        commit = hub.add_repo(REPO, tiny_files())
        port = free_port()
        env = _env(tmp_path, HF_ENDPOINT=hub.endpoint)
        proc = _serve(tmp_path, port, "--model", f"hf://{REPO}", env=env)
        try:
            wait_ready(proc, port)
            assert _models(port) == [REPO]
            status, doc = post(port, {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
            assert status == 200 and doc["model"] == REPO, doc
        finally:
            out = _stop(proc)
        assert f"is {commit} in" in out and "242 tensors match the plan" in out, out
        served = len(hub.requests)
    port = free_port()
    proc = _serve(tmp_path, port, "--model", f"hf://{REPO}", "--offline", env=_env(tmp_path))
    try:
        wait_ready(proc, port)
        status, doc = post(port, {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert status == 200, doc
    finally:
        _stop(proc)
    assert len(hub.requests) == served  # the hub was gone; nothing asked it


def test_serve_refuses_a_bad_or_unreadable_reference_before_loading(tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "serve", "--model", "hf://acme", "--port", "0"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "dsv4 serve: error: --model:" in done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - started < 30
    with FakeHub(tmp_path / "hub") as hub:
        hub.add_repo(REPO, tiny_files(), gated=True, tokens=("hf_granted",))
        done = subprocess.run(
            [sys.executable, "-m", "dsv4_cli", "serve", "--model", f"hf://{REPO}", "--port", "0"],
            env=_env(tmp_path, HF_ENDPOINT=hub.endpoint),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    assert f"--model hf://{REPO}: Unauthorized:" in done.stderr and "401" in done.stderr
    assert [line for line in done.stderr.splitlines() if "Unauthorized" in line] == [
        next(line for line in done.stderr.splitlines() if "dsv4 serve: error:" in line)
    ], done.stderr  # said once, naming the flag


def _up(
    tmp_path: Path, cr: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "dsv4_cli", "up", str(cr), "--port", "0", *args]
    argv += ["--workdir", str(tmp_path / f"work-{len(os.listdir(tmp_path))}")]
    argv += ["--request", "hello", "--max-tokens", "4"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def test_up_plans_from_the_hubs_config_then_fetches_and_serves(tmp_path: Path) -> None:
    cr = tmp_path / "cr.yaml"
    with FakeHub(tmp_path / "hub") as hub:
        commit = hub.add_repo(REPO, tiny_files())
        cr.write_text(CR.format(repo=REPO, endpoint=hub.endpoint))
        done = _up(tmp_path, cr, env=_env(tmp_path))
        assert done.returncode == 0, done.stderr
        assert "completion:" in done.stdout
        err = done.stderr
        # config.json first (planned), then the files, then the processes.
        assert err.index("planning from its config.json") < err.index("fetching hf://")
        assert err.index(f"is {commit} in") < err.index("starting")
        first_weights = next(i for i, r in enumerate(hub.requests) if "/cdn/" in r.path)
        config = next(i for i, r in enumerate(hub.requests) if r.path.endswith("/config.json"))
        assert config < first_weights
        served = len(hub.requests)
    done = _up(tmp_path, cr, "--offline", env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "(--offline)" in done.stderr and "fetching" not in done.stderr
    assert len(hub.requests) == served


def test_up_refuses_a_gated_repo_without_a_token_before_starting(tmp_path: Path) -> None:
    cr = tmp_path / "cr.yaml"
    with FakeHub(tmp_path / "hub") as hub:
        hub.add_repo(REPO, tiny_files(), gated=True, tokens=("hf_granted",))
        cr.write_text(CR.format(repo=REPO, endpoint=hub.endpoint))
        done = _up(tmp_path, cr, env=_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "dsv4 up: error: spec.model.source: Unauthorized:" in done.stderr
    assert sum("Unauthorized" in line for line in done.stderr.splitlines()) == 1, done.stderr
    assert "starting" not in done.stderr
