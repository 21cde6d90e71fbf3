"""Model directories the fetch tests put on the fake hub: the packaged tiny model (loadable, as
`dsv4 serve` loads it) and synthetic checkpoints written from the planner's tensor list with
random bytes (what the tensor check reads is their headers; what the downloads move is their
size), optionally with one tensor changed so the check must name it."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsv4_common.core.hf import parse_hf_config
from dsv4_common.core.model import DSV4Config
from dsv4_common.core.tensors import DTYPE_SIZE
from dsv4_common.plan.checkpoint_match import TensorEntry, planned_tensors

ROOT = Path(__file__).resolve().parents[2]
TINY_DIR = ROOT / "worker" / "dsv4_worker" / "models" / "tiny"


def tiny_files() -> dict[str, Path]:
    """The packaged tiny model's files (config.json, two shards, the index, a README)."""
    return {p.name: p for p in sorted(TINY_DIR.iterdir()) if p.is_file()}


def tiny_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((TINY_DIR / "config.json").read_text())
    config.update(changes)
    return config


def write_safetensors(path: Path, tensors: Mapping[str, TensorEntry], *, random: bool) -> None:
    """A safetensors file holding `tensors` (their bytes random, or zeros)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, entry in tensors.items():
        nbytes = math.prod(entry.shape) * DTYPE_SIZE[entry.dtype]  # type: ignore[index]
        header[name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        left = offset
        while left > 0:
            n = min(left, 4 << 20)
            f.write(os.urandom(n) if random else bytes(n))
            left -= n


def synthetic_checkpoint(
    out: Path,
    config: Mapping[str, Any],
    *,
    shards: int = 2,
    with_draft: bool = True,
    change: Mapping[str, TensorEntry] | None = None,
    random: bool = True,
) -> dict[str, Path]:
    """config.json, `shards` safetensors files of every tensor the plan counts (the MTP layers
    too when `with_draft`), and model.safetensors.index.json; `change` replaces entries."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    model = parse_hf_config(json.dumps(config), name=out.name)
    assert isinstance(model, DSV4Config)
    tensors = dict(planned_tensors(model, with_draft=with_draft))
    tensors.update(change or {})
    names = list(tensors)
    per = -(-len(names) // shards)
    files: dict[str, Path] = {"config.json": out / "config.json"}
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / name, {n: tensors[n] for n in part}, random=random)
        weight_map.update({n: name for n in part})
        files[name] = out / name
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    files[index.name] = index
    return files
