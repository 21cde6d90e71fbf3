"""The files of a HuggingFace model directory, by name (no torch: `dsv4 serve` checks them
before it imports torch; `checkpoint.py` reads them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

__all__ = ["CONFIG", "INDEX", "SINGLE", "is_model_dir", "missing_shards"]

CONFIG: Final = "config.json"
INDEX: Final = "model.safetensors.index.json"
SINGLE: Final = "model.safetensors"


def is_model_dir(path: str | os.PathLike[str]) -> bool:
    """A directory with config.json and safetensors weights (an index or one file)."""
    root = Path(path)
    has_weights = (root / INDEX).is_file() or (root / SINGLE).is_file()
    return root.is_dir() and (root / CONFIG).is_file() and has_weights


def missing_shards(root: Path) -> list[str]:
    """The shard files the directory's index names that are not there (none without an index,
    or with an index that is not JSON: the loader names that problem)."""
    try:
        index = json.loads((root / INDEX).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return []
    shards = {s for s in weight_map.values() if isinstance(s, str)}
    return sorted(s for s in shards if not (root / s).is_file())
