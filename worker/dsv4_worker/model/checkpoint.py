"""Load a HuggingFace DeepSeek-V4 model directory (config.json, model.safetensors.index.json +
shards, or one model.safetensors) into one PP stage's parameters under the published names,
held as stored (`stored.py`: FP8 blocks with their scales, packed FP4 experts with theirs,
floats and integer tables in their dtype), or dequantized to a float dtype when asked.
Side effects: reads files; never downloads.

Steps: (1) config.json against the model; (2) the index's names sorted out (renamed, weights
paired with scales, missing/extra found: `checkpoint_plan.catalog`); (3) the shard headers of
the stage's tensors checked (dtype, shape, scale); (4) tensors read one at a time.
NOTE: a stage opens only the shards holding its tensors, reads only its tensors (and their
scales), one at a time with `safe_open(...).get_tensor`, so besides its own weights it holds
one stored tensor and its scale at a time, never a whole shard. transformers' stacked experts
are split into the published per-expert tensors (FP8 scales sliced by block rows).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model.checkpoint_names import FusedExperts
from dsv4_worker.model.checkpoint_plan import (
    CheckpointError,
    Format,
    Item,
    Meta,
    all_shapes,
    catalog,
    check_config,
    expected_shape,
    stored_format,
)
from dsv4_worker.model.files import CONFIG, INDEX, SINGLE, is_model_dir
from dsv4_worker.model.quant import FP8_BLOCK
from dsv4_worker.model.stored import FP4Packed, FP8Block, Stored, fp8_row_slice
from dsv4_worker.model.weights import check_weights, stage_param_names

__all__ = ["Checkpoint", "CheckpointError", "is_model_dir", "load_checkpoint"]

_MAX_LISTED = 8


@dataclass(frozen=True, slots=True)
class _Read:
    item: Item
    fmt: Format
    cols: int  # the parameter's input width (packed FP4 holds ceil(cols / 2) bytes a row)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One stage's parameters (published names, exactly `stage_param_names`), and the MTP
    layers' (`mtp.K.*`; read when asked, by the last stage only; empty when the checkpoint
    has none). Values are `Stored` as held, or plain tensors of the float dtype asked for."""

    params: dict[str, Stored]
    mtp: dict[str, Stored]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (*self.params.values(), *self.mtp.values()))


def load_checkpoint(
    path: str | os.PathLike[str],
    model: DSV4Config,
    *,
    layers: range | None = None,
    first: bool = True,
    last: bool = True,
    mtp: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Checkpoint:
    """The stage's tensors of `layers` (default: all), the embedding when `first`, the head
    when `last`, and the MTP layers present when `last` and `mtp`; as stored, or dequantized
    to `dtype` (integers stay as stored). Raises CheckpointError naming the tensor and file; the
    names of the whole checkpoint are checked, the headers and data of the stage's tensors
    only."""
    root = Path(path)
    layers = range(model.num_hidden_layers) if layers is None else layers
    if not (0 <= layers.start <= layers.stop <= model.num_hidden_layers and layers.step == 1):
        raise ValueError(f"layers {layers} is not a slice of {model.num_hidden_layers} layers")
    # 1. config.json against the model.
    config = _read_json(root / CONFIG)
    block = _fp8_block(config)
    problems = check_config(config, model)
    # 2. Every name in the index: renamed, paired, nothing missing or extra.
    weight_map = _weight_map(root)
    names = stage_param_names(model, layers, first=first, last=last)
    found = catalog(weight_map, model, names, last and mtp)
    _raise_if(root, [*problems, *found.problems])
    # 3. The stage's headers: dtypes, shapes, scales.
    reads = _check_headers(root, weight_map, found.items, model, block)
    # 4. The stage's tensors, one at a time.
    tensors = _read_items(root, weight_map, reads, dtype, device, block)
    params = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    check_weights(model, params, names)
    return Checkpoint(params, {n: t for n, t in tensors.items() if n.startswith("mtp.")})


def _check_headers(
    root: Path,
    weight_map: Mapping[str, str],
    items: tuple[Item, ...],
    model: DSV4Config,
    block: tuple[int, int],
) -> list[_Read]:
    metas = _read_metas(root, weight_map, items)
    shapes = all_shapes(model)
    reads: list[_Read] = []
    problems: list[str] = []
    for item in items:
        scale = metas.get(item.scale) if item.scale is not None else None
        expected = expected_shape(item.target, model, shapes)
        try:
            fmt = stored_format(item, weight_map, metas[item.source], scale, expected, block)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        reads.append(_Read(item, fmt, expected[-1]))
    _raise_if(root, problems)
    return reads


def _raise_if(root: Path, problems: list[str]) -> None:
    if not problems:
        return
    listed = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    lines = "\n  ".join(listed)
    raise CheckpointError(f"checkpoint {root} cannot be loaded:\n  {lines}{more}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def _fp8_block(config: Mapping[str, Any]) -> tuple[int, int]:
    quant = config.get("quantization_config")
    size = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if size is None:
        return FP8_BLOCK
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) for v in size)):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size {size!r}")
    return size[0], size[1]


def _weight_map(root: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (or the one file's header)."""
    if not (root / INDEX).is_file():
        if not (root / SINGLE).is_file():
            raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE}")
        with _open(root, SINGLE) as f:
            return dict.fromkeys(f.keys(), SINGLE)
    index = _read_json(root / INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{root / INDEX}: no weight_map object")
    problems: list[str] = []
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            problems.append(f"{INDEX}: {name} is in {shard!r}, not a file name")
        elif not (root / shard).is_file():
            problems.append(f"{INDEX}: {name} is in {shard}, which does not exist")
    _raise_if(root, problems)
    return weight_map


@contextmanager
def _open(root: Path, shard: str) -> Iterator[Any]:
    try:
        with safe_open(str(root / shard), framework="pt", device="cpu") as f:
            yield f
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{root / shard}: not a readable safetensors file ({e})") from None


def _by_shard(weight_map: Mapping[str, str], names: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for n in names:
        groups[weight_map[n]].append(n)
    return dict(sorted(groups.items()))


def _read_metas(
    root: Path, weight_map: Mapping[str, str], items: tuple[Item, ...]
) -> dict[str, Meta]:
    """The headers of the items' tensors and scales, opening each of their shards once."""
    names = [n for i in items for n in (i.source, i.scale) if n is not None]
    metas: dict[str, Meta] = {}
    problems: list[str] = []
    for shard, group in _by_shard(weight_map, names).items():
        with _open(root, shard) as f:
            present = set(f.keys())
            for n in group:
                if n not in present:
                    problems.append(f"{n}: the index puts it in {shard}, which does not hold it")
                    continue
                view = f.get_slice(n)
                metas[n] = Meta(view.get_dtype(), tuple(view.get_shape()))
    _raise_if(root, problems)
    return metas


def _read_items(
    root: Path,
    weight_map: Mapping[str, str],
    reads: list[_Read],
    dtype: torch.dtype | None,
    device: torch.device | str,
    block: tuple[int, int],
) -> dict[str, Stored]:
    """Every item, shard by shard; scales stored in another shard come from one more open
    shard (at most two open at once)."""
    by_source = {r.item.source: r for r in reads}
    out: dict[str, Stored] = {}
    for shard, group in _by_shard(weight_map, list(by_source)).items():
        with _open(root, shard) as f, _OtherShard(root) as other:
            for name in group:
                read = by_source[name]
                stored = f.get_tensor(name)
                scale = None
                if read.item.scale is not None:
                    scale_shard = weight_map[read.item.scale]
                    source = f if scale_shard == shard else other.get(scale_shard)
                    scale = _checked_scale(source.get_tensor(read.item.scale), read, weight_map)
                parts = _decode(stored, scale, read, block)
                del stored, scale
                for n, value in parts.items():
                    out[n] = placed(value, dtype, device)
    return out


class _OtherShard:
    """The one extra shard kept open for scales stored apart from their weights."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._stack = ExitStack()
        self._name: str | None = None
        self._handle: Any = None

    def get(self, shard: str) -> Any:
        if shard != self._name:
            self._stack.close()
            self._handle = self._stack.enter_context(_open(self._root, shard))
            self._name = shard
        return self._handle

    def __enter__(self) -> _OtherShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _checked_scale(scale: torch.Tensor, read: _Read, weight_map: Mapping[str, str]) -> torch.Tensor:
    if not bool(torch.isfinite(scale.to(torch.float64)).all()):
        name = read.item.scale
        assert name is not None
        where = f"{name} ({weight_map[name]})"
        raise CheckpointError(f"{where}: the scale holds NaN or infinite values")
    return scale


def _decode(
    stored: torch.Tensor, scale: torch.Tensor | None, read: _Read, block: tuple[int, int]
) -> dict[str, Stored]:
    """The item's parameters as held, each in storage of its own (never a view of the read
    buffer): floats and integers as they are, FP8 with its block scale, FP4 packed with its
    group scale; transformers' stacked experts split per expert."""
    target = read.item.target
    if read.fmt == "int":
        return {_single(target): stored.clone()}
    if read.fmt == "float":
        if isinstance(target, FusedExperts):
            return dict(target.split(stored))
        return {target: stored.clone()}
    assert scale is not None, read.item
    if not isinstance(target, FusedExperts):
        return {target: _quantized(stored, scale, read, block)}
    out: dict[str, Stored] = {}
    for e in range(stored.shape[0]):
        whole = _quantized(stored[e], scale[e], read, block)
        prefix = f"{target.scope}.ffn.experts.{e}"
        if target.kind == "down":
            out[f"{prefix}.w2.weight"] = whole
            continue
        inter = whole.shape[0] // 2
        out[f"{prefix}.w1.weight"] = _rows(whole, 0, inter)
        out[f"{prefix}.w3.weight"] = _rows(whole, inter, 2 * inter)
    return out


def _single(target: object) -> str:
    assert isinstance(target, str), target
    return target


def _quantized(
    values: torch.Tensor, scale: torch.Tensor, read: _Read, block: tuple[int, int]
) -> FP8Block | FP4Packed:
    if read.fmt == "fp8":
        return FP8Block(values.clone(), scale.clone(), block)
    return FP4Packed(values.view(torch.int8).clone(), scale.clone(), read.cols)


def _rows(w: FP8Block | FP4Packed, start: int, stop: int) -> FP8Block | FP4Packed:
    """Rows [start, stop) of a quantized matrix, in storage of their own."""
    if isinstance(w, FP8Block):
        return fp8_row_slice(w, start, stop)
    return FP4Packed(w.packed[start:stop].clone(), w.scale[start:stop].clone(), w.cols)


def placed(value: Stored, dtype: torch.dtype | None, device: torch.device | str) -> Stored:
    """`value` on `device`; a float or quantized one dequantized to `dtype` when asked."""
    if isinstance(value, torch.Tensor):
        if dtype is None or not value.is_floating_point():
            return value.to(device)
        return value.to(device=device, dtype=dtype)
    if dtype is not None:
        out = torch.empty(value.shape, dtype=torch.float64)
        return value.dequantize_into(out).to(device=device, dtype=dtype)
    if isinstance(value, FP8Block):
        return FP8Block(
            value.values.to(device), value.scale.to(device), value.block, value.row_offset
        )
    return FP4Packed(value.packed.to(device), value.scale.to(device), value.cols)
