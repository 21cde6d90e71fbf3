"""What a checkpoint holds and what one PP stage must read from it, decided from names, dtypes
and shapes only (the index and the shard headers): pure, no tensor data, no files.

Every problem found becomes one line naming the tensor and its file; `checkpoint.py` raises
them together as one `CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from dsv4_common.core.model import DSV4Config
from dsv4_worker.model.checkpoint_names import (
    FusedExperts,
    Target,
    mtp_param_shapes,
    published_name,
    scale_owner,
)
from dsv4_worker.model.quant import FP4_GROUP
from dsv4_worker.model.weights import INTEGER_SUFFIXES, Shapes, WeightsError, param_shapes

Format = Literal["float", "int", "fp8", "fp4"]
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
INT_DTYPES = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})
FP8_DTYPE = "F8_E4M3"
FP4_DTYPES = frozenset({"I8", "U8"})  # two e2m1 values per byte
SCALE_DTYPES = frozenset({"F8_E8M0", "F32"})
_SUPPORTED = (
    "BF16/F16/F32/F64, F8_E4M3 with a block scale, I8/U8 packed FP4 with a group scale, "
    "integers for tid2eid"
)


class CheckpointError(WeightsError):
    """A model directory that cannot be loaded; each line names the tensor and its file."""


@dataclass(frozen=True, slots=True)
class Meta:
    """A stored tensor's header: safetensors dtype name (`F8_E4M3`, ...) and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Item:
    """One parameter (or one layer's stacked experts) to load: its tensor and scale names."""

    source: str
    target: Target
    scale: str | None = None


@dataclass(frozen=True, slots=True)
class Catalog:
    """The checkpoint's names sorted out: the items of one stage, and what is wrong."""

    items: tuple[Item, ...]
    problems: tuple[str, ...]


def target_names(target: Target, model: DSV4Config) -> list[str]:
    if isinstance(target, FusedExperts):
        return target.names(model.weights.num_routed_experts)
    return [target]


def expected_shape(target: Target, model: DSV4Config, shapes: Shapes) -> tuple[int, ...]:
    if isinstance(target, FusedExperts):
        return target.shape(shapes, model.weights.num_routed_experts)
    return shapes[target]


def all_shapes(model: DSV4Config) -> Shapes:
    """Target layers' and MTP layers' parameters."""
    return param_shapes(model) | mtp_param_shapes(model)


def catalog(
    weight_map: Mapping[str, str], model: DSV4Config, stage_names: Iterable[str], last: bool
) -> Catalog:
    """Pair weights with scales, rename them, find missing and extra tensors, and keep the items
    of the stage (`stage_names`, plus the MTP layers present when `last`)."""
    known = all_shapes(model)
    problems: list[str] = []
    weights: dict[Target, str] = {}
    scales: dict[Target, str] = {}

    def where(name: str) -> str:
        return f"{name} ({weight_map[name]})"

    def recognize(name: str) -> Target | None:
        target = published_name(name)
        ok = all(n in known for n in target_names(target, model))
        return target if ok else None

    for name in sorted(weight_map):
        target = recognize(name)
        owner = scale_owner(name) if target is None else None
        owner_target = recognize(owner) if owner is not None else None
        if target is not None:
            table = weights
        elif owner_target is not None:
            table, target = scales, owner_target
        else:
            problems.append(f"{where(name)}: not a model tensor, an MTP tensor or a scale")
            continue
        if target in table:
            problems.append(f"{where(name)} and {where(table[target])} hold the same tensor")
            continue
        table[target] = name
    for target, name in sorted(scales.items(), key=lambda kv: kv[1]):
        if target not in weights:
            problems.append(f"{where(name)}: a scale without its weight")

    covered: dict[str, str] = {}
    for target, name in weights.items():
        for n in target_names(target, model):
            if n in covered:
                problems.append(f"{where(name)} and {where(covered[n])} both hold {n}")
            covered[n] = name
    mtp_scopes = {".".join(n.split(".")[:2]) + "." for n in covered if n.startswith("mtp.")}
    required = [n for n in known if not n.startswith("mtp.") or n.startswith(tuple(mtp_scopes))]
    missing = [n for n in required if n not in covered]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"missing tensors: {', '.join(missing[:5])}{more}")

    wanted = set(stage_names)
    if last:
        wanted |= {n for n in covered if n.startswith("mtp.")}
    items = tuple(
        Item(name, target, scales.get(target))
        for target, name in sorted(weights.items(), key=lambda kv: kv[1])
        if all(n in wanted for n in target_names(target, model))
    )
    return Catalog(items, tuple(problems))


def _grid(shape: tuple[int, ...], rows: int, cols: int) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))


def stored_format(
    item: Item,
    where: Mapping[str, str],
    weight: Meta,
    scale: Meta | None,
    expected: tuple[int, ...],
    fp8_block: tuple[int, int],
) -> Format:
    """How the item is stored, after checking its dtype and shape and its scale's; raises
    CheckpointError naming the tensor and file. `where` maps tensor names to files."""
    src = f"{item.source} ({where[item.source]})"
    integer = isinstance(item.target, str) and item.target.endswith(INTEGER_SUFFIXES)
    fmt: Format
    if integer:
        if weight.dtype not in INT_DTYPES:
            raise CheckpointError(f"{src}: dtype {weight.dtype}, expected an integer dtype")
        fmt, stored = "int", expected
    elif weight.dtype in FLOAT_DTYPES:
        fmt, stored = "float", expected
    elif weight.dtype == FP8_DTYPE:
        fmt, stored = "fp8", expected
    elif weight.dtype in FP4_DTYPES:
        fmt, stored = "fp4", (*expected[:-1], -(-expected[-1] // 2))
    else:
        raise CheckpointError(f"{src}: dtype {weight.dtype} is not supported ({_SUPPORTED})")
    if weight.shape != stored:
        note = f" (packed FP4 of {list(expected)})" if fmt == "fp4" else ""
        raise CheckpointError(f"{src}: shape {list(weight.shape)}, expected {list(stored)}{note}")
    if fmt in ("int", "float"):
        if item.scale is not None:
            sname = f"{item.scale} ({where[item.scale]})"
            raise CheckpointError(f"{src}: stored {weight.dtype}, yet has a scale {sname}")
        return fmt
    if scale is None or item.scale is None:
        raise CheckpointError(f"{src}: stored {weight.dtype} (quantized) without its scale")
    if len(expected) < 2:
        raise CheckpointError(f"{src}: stored {weight.dtype}, but only matrices are quantized")
    sname = f"{item.scale} ({where[item.scale]})"
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{sname}: scale dtype {scale.dtype} is not supported (F8_E8M0, F32)")
    grid = _grid(expected, *fp8_block) if fmt == "fp8" else _grid(expected, 1, FP4_GROUP)
    if scale.shape != grid:
        raise CheckpointError(f"{sname}: scale shape {list(scale.shape)}, expected {list(grid)}")
    return fmt


def _hash_layers(config: Mapping[str, object]) -> object:
    types = config.get("mlp_layer_types")
    if isinstance(types, list):
        return sum(t == "hash_moe" for t in types)
    return config.get("num_hash_layers")


def _ratios(config: Mapping[str, object], layers: int) -> object:
    ratios = config.get("compress_ratios")
    if isinstance(ratios, list):
        return tuple(ratios[:layers])
    types, rates = config.get("layer_types"), config.get("compress_rates")
    if isinstance(types, list) and isinstance(rates, dict):
        return tuple(0 if t == "sliding_attention" else rates.get(t) for t in types[:layers])
    return None


def check_config(config: Mapping[str, object], model: DSV4Config) -> list[str]:
    """config.json's shape-bearing fields against the model; a field it omits is not checked."""
    w, a = model.weights, model.arch
    fields: dict[str, object] = {
        "vocab_size": w.vocab_size,
        "hidden_size": w.hidden_size,
        "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": w.num_attention_heads,
        "head_dim": model.head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "q_lora_rank": w.q_lora_rank,
        "o_lora_rank": w.o_lora_rank,
        "o_groups": a.o_groups,
        "hc_mult": a.hc_mult,
        "n_routed_experts": w.num_routed_experts,
        "n_shared_experts": w.num_shared_experts,
        "moe_intermediate_size": w.moe_intermediate_size,
        "num_experts_per_tok": w.num_experts_per_token,
        "index_n_heads": model.index_n_heads,
        "index_head_dim": model.index_head_dim,
        "num_nextn_predict_layers": model.num_nextn_predict_layers,
    }
    found: dict[str, object] = {k: config.get(k) for k in fields}
    fields["hash layers (num_hash_layers / mlp_layer_types)"] = a.num_hash_layers
    found["hash layers (num_hash_layers / mlp_layer_types)"] = _hash_layers(config)
    fields["compress ratios (compress_ratios / layer_types)"] = model.target_ratios
    found["compress ratios (compress_ratios / layer_types)"] = _ratios(
        config, model.num_hidden_layers
    )
    return [
        f"config.json: {k} is {found[k]!r}, the model ({model.name}) has {v!r}"
        for k, v in fields.items()
        if found[k] is not None and found[k] != v
    ]
