"""`dsv4 up` (PD: router, prefill, decode, KV over NIXL) serving a DeepSeek-V4 checkpoint that
transformers' save_pretrained wrote (resharded with an index), named by `model.configPath`:
greedy output through the router equals transformers' own generation, token for token."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_support import hf_greedy, save_model_dir
from serve_support import free_port, post

from dsv4_common.core.presets import tiny

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

PROMPT = [((17 * i) % 250) + 3 for i in range(50)]
NEW_TOKENS = 10
CR = """\
apiVersion: serving.dsv4.io/v1alpha1
kind: DSV4Deployment
metadata:
  name: model-dir
spec:
  model:
    configPath: {root}
  maxContextTokens: 1024
  kv:
    pageSize: 16
    transfer: nixl
  prefill:
    replicas: 1
    chunkedPrefillTokens: 32
  decode:
    replicas: 1
    maxRunningRequests: 8
"""


def test_a_transformers_checkpoint_through_a_local_pd_deployment(tmp_path: Path) -> None:
    root = tmp_path / "model"
    reference = save_model_dir(tiny(), seed=9, root=root)
    want, _ = hf_greedy(reference, PROMPT, NEW_TOKENS)
    cr = tmp_path / "cr.yaml"
    cr.write_text(CR.format(root=root))
    port = free_port()
    argv = [sys.executable, "-m", "dsv4_cli", "up", str(cr), "--port", str(port)]
    up = subprocess.Popen(
        [*argv, "--workdir", str(tmp_path / "work")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    seen = ""
    try:
        deadline = time.monotonic() + 300
        while "Ctrl-C stops every process" not in seen:
            assert time.monotonic() < deadline and up.poll() is None, seen
            seen += up.stdout.readline()
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        status, doc = post(port, {**body, "return_token_ids": True})
        assert status == 200, doc
        assert doc["choices"][0]["token_ids"] == want
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
