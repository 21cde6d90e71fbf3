"""A checkpoint's tensor index (name -> dtype and shape) from its safetensors headers alone: the
8-byte little-endian header length, then the JSON header (the format's specification), never
the tensor data. The files are those `model.safetensors.index.json` maps, else every
`*.safetensors` in the directory."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Final

from dsv4_common.core.tensors import DTYPE_SIZE
from dsv4_common.plan.checkpoint_match import TensorEntry
from dsv4_fetch.errors import FetchError

INDEX_FILE: Final = "model.safetensors.index.json"
MAX_HEADER_BYTES: Final = 100 << 20  # safetensors' own bound


def read_index(model_dir: Path) -> dict[str, TensorEntry]:
    index: dict[str, TensorEntry] = {}
    where: dict[str, str] = {}
    for path in checkpoint_files(model_dir):
        for name, entry in read_header(path).items():
            if name in index:
                raise FetchError("TensorMismatch", f"{name}: in both {where[name]} and {path.name}")
            index[name], where[name] = entry, path.name
    return index


def checkpoint_files(model_dir: Path) -> list[Path]:
    mapped = model_dir / INDEX_FILE
    if mapped.is_file():
        try:
            weight_map = json.loads(mapped.read_text())["weight_map"]
            names = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FetchError("TensorMismatch", f"{INDEX_FILE}: unreadable ({exc})") from exc
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FetchError("TensorMismatch", f"{INDEX_FILE} maps to missing {missing[0]}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FetchError("TensorMismatch", f"{model_dir.name}: no *.safetensors file")
    return files


def read_header(path: Path) -> dict[str, TensorEntry]:
    """One file's tensors; a header that does not describe the file's bytes is refused."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header length")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header of {length} bytes")
            raw = json.loads(f.read(length))
        size = path.stat().st_size
    except (OSError, ValueError) as exc:
        raise FetchError("TensorMismatch", f"{path.name}: not a safetensors file ({exc})") from exc
    if not isinstance(raw, dict):
        raise FetchError("TensorMismatch", f"{path.name}: the header is not a JSON object")
    out: dict[str, TensorEntry] = {}
    end = 0
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
            start, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FetchError("TensorMismatch", f"{path.name}: {name}: bad entry ({exc})") from exc
        item = DTYPE_SIZE.get(dtype)  # type: ignore[call-overload]
        if item is not None and stop - start != math.prod(shape) * item:
            raise FetchError(
                "TensorMismatch",
                f"{path.name}: {name}: {stop - start} bytes for {dtype} {list(shape)}",
            )
        end = max(end, stop)
        out[name] = TensorEntry(dtype, shape)
    if 8 + length + end > size:
        raise FetchError("TensorMismatch", f"{path.name}: truncated ({size} bytes)")
    return out
