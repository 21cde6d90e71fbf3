"""The name a model directory is served under when no --served-model-name (or CR
servedModelNames) gives one: the directory's, or in a Hugging Face hub cache (whose snapshot
directories are named by revision) the repository id."""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath

import pytest
from repo_paths import MODEL_DATA

from dsv4_common.core.hf import config_model_name
from dsv4_common.core.presets import load_model_config


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/models/DeepSeek-V4-Flash/config.json", "DeepSeek-V4-Flash"),
        (
            "/root/.cache/huggingface/hub/models--deepseek-ai--DeepSeek-V4-Flash/snapshots/"
            "0123abcd/config.json",
            "deepseek-ai/DeepSeek-V4-Flash",
        ),
        ("/hub/models--gpt2/snapshots/0123abcd/config.json", "gpt2"),
        ("/data/snapshots/0123abcd/config.json", "0123abcd"),  # not a hub cache
        ("/config.json", "config"),
    ],
)
def test_the_name_of_a_config_file(path: str, name: str) -> None:
    assert config_model_name(PurePosixPath(path)) == name


def test_a_directory_given_relatively_is_named_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model .` (or `./config.json`) is the current directory's model, not `config`."""
    root = tmp_path / "my-model"
    root.mkdir()
    shutil.copy(MODEL_DATA / "deepseek-v4-flash" / "config.json", root / "config.json")
    monkeypatch.chdir(root)
    for given in (".", "config.json", "./config.json", "../my-model"):
        assert load_model_config(given).name == "my-model", given


def test_a_name_field_in_config_json_is_not_used(tmp_path: Path) -> None:
    """transformers < 5 wrote `_name_or_path`: where the weights were loaded from (a base
    model's id, a training machine's path), not this model's name."""
    raw = json.loads((MODEL_DATA / "deepseek-v4-flash" / "config.json").read_text())
    raw["_name_or_path"] = "/mnt/train/checkpoints/step-1000"
    root = tmp_path / "flash-finetune"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(raw))
    assert load_model_config(str(root)).name == "flash-finetune"
