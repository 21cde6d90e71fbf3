"""The tiny preset ships trained weights (worker/dsv4_worker/models/tiny, written by
scripts/train_tiny.py in the release's format): its config equals the preset, the checkpoint
loads, and its greedy text is English words (worker/tests/server/test_serve_model_dir.py: `dsv4
serve --model tiny` serves them unless a --seed asks for random weights)."""

from __future__ import annotations

import dataclasses

import pytest
from hf_support import hf_greedy

from dsv4_common.core.presets import load_model_config, tiny
from dsv4_worker.model.checkpoint import load_checkpoint
from dsv4_worker.model.oracle import oracle_greedy
from dsv4_worker.model.weights import init_weights, param_shapes
from dsv4_worker.precheck import PACKAGED_MODELS, packaged_weights

ROOT = PACKAGED_MODELS / "tiny"


def test_the_shipped_directory_is_the_tiny_preset_in_the_release_format() -> None:
    assert packaged_weights("tiny") == str(ROOT)
    assert packaged_weights("hybrid-tiny") is None and packaged_weights("../tiny") is None
    assert dataclasses.replace(load_model_config(str(ROOT)), name="tiny") == tiny()
    assert (ROOT / "model.safetensors.index.json").is_file()
    size_bytes = sum(f.stat().st_size for f in ROOT.iterdir())
    assert size_bytes < 20 << 20


def test_the_shipped_weights_load_and_write_english_words() -> None:
    params = load_checkpoint(ROOT, tiny()).params
    assert {k: tuple(v.shape) for k, v in params.items()} == param_shapes(tiny())
    random = init_weights(tiny(), seed=0)
    assert any(not (params[k] == random[k]).all() for k in params if k.endswith("wq_a.weight"))
    text = bytes(oracle_greedy(tiny(), params, list(b"The "), 48)).decode("latin-1")
    words = [w for w in text.replace(",", " ").replace(".", " ").split() if w.isalpha()]
    # Trained, the continuation is mostly lowercase ASCII words, not byte noise.
    assert text.isprintable(), text
    assert len(words) >= 4 and sum(w.islower() for w in words) >= 3, text


def test_transformers_loads_the_shipped_directory_and_continues_as_we_do() -> None:
    """`from_pretrained` on the shipped directory as it is: every tensor found under the
    release's names, and the same greedy tokens as our oracle. transformers maps the release's
    compress_ratios by a fixed table (0, 4, 128), so config.json also carries layer_types and
    compress_rates (HCA 16), as release_config writes them for such a model."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        ROOT,
        output_loading_info=True,
        attn_implementation="eager",
        experts_implementation="eager",  # float64 below: grouped_mm takes fp32/bf16 only
    )
    assert not any(info.values()), info  # nothing missing, unexpected or mis-shaped
    model = model.double().eval()  # float64, as the oracle runs: the same greedy choices
    prompt = list(b"This License applies to")
    theirs, _ = hf_greedy(model, prompt, 16)
    params = load_checkpoint(ROOT, tiny()).params
    assert theirs == oracle_greedy(tiny(), params, prompt, 16)
