"""Does a checkpoint hold the tensors the plan counts? Its tensor index (name -> dtype and shape,
read from the safetensors headers) against the planner's tensor list (`core.tensors`: the one
source of names, shapes and stored dtypes the weight bytes are counted from). Pure.

Every tensor the plan counts must be there with its dtype and shape: the target layers, the
embedding, the head and, when `with_draft`, the MTP layers. A checkpoint may also hold MTP layers
the plan does not count (they are not loaded); anything else it holds is a mismatch too, since
the plan did not count its bytes. The first difference is named, in the planner's order (then
unexpected names, sorted), so two runs name the same one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_common.core.tensors import (
    checkpoint_params,
    embedding_params,
    head_params,
    layer_params,
    mtp_params,
    stored_tensors,
)

MTP_PREFIX: Final = "mtp."


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as a checkpoint stores it (safetensors' dtype names: BF16, F8_E4M3, I8...)."""

    dtype: str
    shape: tuple[int, ...]


TensorIndex = Mapping[str, TensorEntry]


@dataclass(frozen=True, slots=True)
class Mismatch:
    tensor: str
    message: str  # names the tensor, what the plan counts and what the checkpoint holds


def published_names(index: TensorIndex) -> bool:
    """The index spells tensors as the release does (the planner's names). transformers' layouts
    (`model.layers...`, stacked experts) are not compared here: the worker's loader renames and
    checks them when it loads."""
    return not any(name.startswith("model.") for name in index)


def planned_tensors(model: DSV4Config, *, with_draft: bool) -> Iterator[tuple[str, TensorEntry]]:
    """The tensors the plan counts, in its order (expert copies expanded)."""
    params = embedding_params(model) + head_params(model)
    for layer in range(model.num_hidden_layers):
        params += layer_params(model, layer)
    if with_draft:
        for index in range(model.num_nextn_predict_layers):
            params += mtp_params(model, index)
    for t in stored_tensors(model, params):
        names = (
            tuple(t.name.format(e=e) for e in range(t.copies))
            if t.copies > 1 or "{e}" in t.name
            else (t.name,)
        )
        for name in names:
            yield name, TensorEntry(t.dtype, t.shape)


def first_mismatch(model: ModelConfig, index: TensorIndex, *, with_draft: bool) -> Mismatch | None:
    """The first tensor where `index` differs from the plan; None when it matches (and always
    for the generic hybrid family, which has no per-tensor list)."""
    if not isinstance(model, DSV4Config):
        return None
    expected = dict(planned_tensors(model, with_draft=with_draft))
    for name, want in expected.items():
        have = index.get(name)
        if have is None:
            return Mismatch(name, f"{name}: missing (the plan counts {_fmt(want)})")
        if have != want:
            return Mismatch(
                name, f"{name}: the checkpoint holds {_fmt(have)}, the plan counts {_fmt(want)}"
            )
    for name in sorted(index):
        if name not in expected and not name.startswith(MTP_PREFIX):
            return Mismatch(
                name,
                f"{name}: {_fmt(index[name])} in the checkpoint is not a tensor of "
                f"{model.name} as the plan counts it",
            )
    return None


def has_draft_layers(model: ModelConfig, index: TensorIndex) -> bool:
    """The checkpoint holds every MTP tensor, as the plan counts them (speculation can load)."""
    if not isinstance(model, DSV4Config) or model.num_nextn_predict_layers == 0:
        return False
    draft = [p for p in checkpoint_params(model) if p.name.startswith(MTP_PREFIX)]
    for t in stored_tensors(model, tuple(draft)):
        names = [t.name.format(e=e) for e in range(t.copies)] if "{e}" in t.name else [t.name]
        if any(index.get(n) != TensorEntry(t.dtype, t.shape) for n in names):
            return False
    return True


def _fmt(entry: TensorEntry) -> str:
    return f"{entry.dtype} {list(entry.shape)}"
