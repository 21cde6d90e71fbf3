"""`dsv4 serve --model DIR` on a DeepSeek-V4 checkpoint written by transformers'
save_pretrained and resharded with an index: config, weights (transformers' names) and the
byte tokenizer come from the directory, and greedy output equals transformers' own
generation, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_support import hf_greedy, save_model_dir
from serve_support import Deployment, free_port, post, serve_argv

from dsv4_common.core.presets import tiny

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

PROMPT = [((13 * i) % 250) + 3 for i in range(45)]  # past the window and several c4/c16 blocks
NEW_TOKENS = 12


def test_a_transformers_checkpoint_serves_what_transformers_generates(tmp_path: Path) -> None:
    root = tmp_path / "model"
    reference = save_model_dir(tiny(), seed=5, root=root)
    want, _ = hf_greedy(reference, PROMPT, NEW_TOKENS)
    port = free_port()
    deployment = Deployment()
    try:
        deployment.start("serve", serve_argv("--model", str(root), "--port", str(port)), port)
        deployment.ready()
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "return_token_ids": True}
        status, doc = post(port, {**body, "temperature": 0})
        assert status == 200, doc
        assert doc["choices"][0]["token_ids"] == want
    finally:
        deployment.stop()


def test_a_checkpoint_with_a_missing_tensor_exits_2_naming_it(tmp_path: Path) -> None:
    import json
    import subprocess

    root = tmp_path / "model"
    save_model_dir(tiny(), seed=5, root=root)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    dropped = next(n for n in index["weight_map"] if n.endswith("attn.wq_a.weight"))
    del index["weight_map"][dropped]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    done = subprocess.run(
        serve_argv("--model", str(root), "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "missing tensors" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("seed", [None, 4])
def test_the_tiny_preset_serves_its_shipped_weights_unless_a_seed_is_given(
    seed: int | None,
) -> None:
    from dsv4_worker.model.checkpoint import load_checkpoint
    from dsv4_worker.model.oracle import oracle_greedy
    from dsv4_worker.model.weights import init_weights
    from dsv4_worker.precheck import PACKAGED_MODELS

    if seed is None:
        weights = load_checkpoint(PACKAGED_MODELS / "tiny", tiny()).params
    else:
        weights = init_weights(tiny(), seed=seed)
    prompt = list(b"The ")
    want = oracle_greedy(tiny(), weights, prompt, 8)
    port = free_port()
    argv = ["--model", "tiny", "--port", str(port)]
    argv += [] if seed is None else ["--seed", str(seed)]
    deployment = Deployment()
    try:
        deployment.start("serve", serve_argv(*argv), port)
        deployment.ready()
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        status, doc = post(port, body)
        assert status == 200, doc
        assert doc["choices"][0]["token_ids"] == want
    finally:
        deployment.stop()


def test_a_released_directory_serves_on_cpu_with_its_fp8_kv_rows(tmp_path: Path) -> None:
    """A directory as DeepSeek releases one (FP8/FP4 weights, `quantization_config`, no
    `kv_cache_dtype` key of ours) serves on CPU as it is: its KV rows are the release's fp8
    pages, the greedy tokens equal the naive oracle reading rows of the same format (both in
    float32, a CPU worker's compute dtype), and /status reports the weight bytes held equal to
    the plan's."""
    import torch
    from release_support import release_model, write_release_dir

    from dsv4_common.core.presets import load_model_config
    from dsv4_worker.model.checkpoint import load_checkpoint
    from dsv4_worker.model.oracle import oracle_greedy
    from dsv4_worker.model.params import Params

    root = tmp_path / "released"
    write_release_dir(root, release_model(), seed=6)
    model = load_model_config(str(root))
    assert model.kv_dtype == "fp8_e4m3"
    assert isinstance(model, type(release_model()))
    held = Params.of(load_checkpoint(root, model).params, torch.float32)
    want = oracle_greedy(model, held, PROMPT, NEW_TOKENS)
    port = free_port()
    deployment = Deployment()
    try:
        served = deployment.start(
            "serve", serve_argv("--model", str(root), "--port", str(port)), port
        )
        deployment.ready()
        body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        status, doc = post(port, {**body, "return_token_ids": True})
        assert status == 200, doc
        assert doc["choices"][0]["token_ids"] == want
        code, text = served.get("/status")
        assert code == 200, text
        weights = json.loads(text)["weights"]
        assert weights["held_bytes"] == weights["planned_bytes"] > 0, weights
        assert weights["compute_dtype"] == "float32"
    finally:
        deployment.stop()
