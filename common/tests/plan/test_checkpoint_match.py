"""The tensor check against the planner's list: a checkpoint as the plan counts it matches; the
first tensor that differs (missing, another shape or dtype, one the plan does not count) is
named, in the planner's order; MTP layers are optional unless the plan speculates."""

from __future__ import annotations

import math

from dsv4_common.core.presets import load_model_config
from dsv4_common.core.tensors import DTYPE_SIZE, checkpoint_params, stored_tensors
from dsv4_common.plan.checkpoint_match import (
    TensorEntry,
    first_mismatch,
    has_draft_layers,
    planned_tensors,
    published_names,
)
from dsv4_common.plan.weights import estimate_weight_bytes

FLASH = load_model_config("deepseek-v4-flash")
TINY = load_model_config("tiny")


def index(model, *, with_draft: bool):  # type: ignore[no-untyped-def]
    return dict(planned_tensors(model, with_draft=with_draft))


def test_the_planned_list_is_what_the_planner_counts() -> None:
    """Its bytes are the planner's weight count of one rank holding everything at TP 1."""
    total = sum(
        math.prod(e.shape) * DTYPE_SIZE[e.dtype]  # type: ignore[index]
        for e in index(FLASH, with_draft=True).values()
    )
    counted = estimate_weight_bytes(
        FLASH, range(FLASH.num_hidden_layers), first=True, last=True, with_draft=True, tp_size=1
    )
    assert total == counted
    names = {t.name for t in stored_tensors(FLASH, checkpoint_params(FLASH))}
    assert {n for n in names if "{e}" not in n} <= set(index(FLASH, with_draft=True))


def test_a_checkpoint_as_planned_matches() -> None:
    assert first_mismatch(FLASH, index(FLASH, with_draft=False), with_draft=False) is None
    assert first_mismatch(FLASH, index(FLASH, with_draft=True), with_draft=False) is None
    assert has_draft_layers(FLASH, index(FLASH, with_draft=True))
    assert not has_draft_layers(FLASH, index(FLASH, with_draft=False))


def test_the_first_difference_is_named_in_plan_order() -> None:
    got = index(FLASH, with_draft=False)
    got.pop("layers.3.ffn.experts.7.w2.weight")
    got["layers.2.attn.wq_a.weight"] = TensorEntry("BF16", got["layers.2.attn.wq_a.weight"].shape)
    m = first_mismatch(FLASH, got, with_draft=False)
    assert m is not None and m.tensor == "layers.2.attn.wq_a.weight"
    assert "the checkpoint holds BF16" in m.message and "the plan counts F8_E4M3" in m.message
    got["layers.2.attn.wq_a.weight"] = index(FLASH, with_draft=False)["layers.2.attn.wq_a.weight"]
    m = first_mismatch(FLASH, got, with_draft=False)
    assert m is not None and m.message.startswith("layers.3.ffn.experts.7.w2.weight: missing")


def test_a_tensor_the_plan_does_not_count_is_a_mismatch_but_mtp_is_not() -> None:
    got = index(TINY, with_draft=True)
    assert first_mismatch(TINY, got, with_draft=False) is None
    got["layers.0.attn.rotary.inv_freq"] = TensorEntry("F32", (16,))
    m = first_mismatch(TINY, got, with_draft=False)
    assert m is not None and m.tensor == "layers.0.attn.rotary.inv_freq"
    assert "not a tensor of tiny as the plan counts it" in m.message


def test_missing_mtp_layers_fail_only_a_speculating_plan() -> None:
    got = index(TINY, with_draft=False)
    assert first_mismatch(TINY, got, with_draft=False) is None
    m = first_mismatch(TINY, got, with_draft=True)
    assert m is not None and m.tensor.startswith("mtp.0.")


def test_the_generic_hybrid_family_is_not_checked() -> None:
    assert first_mismatch(load_model_config("hybrid-tiny"), {}, with_draft=False) is None


def test_transformers_names_are_told_apart() -> None:
    got = index(TINY, with_draft=False)
    assert published_names(got)
    assert not published_names({"model.layers.0.attn.wq_a.weight": TensorEntry("F32", (1,))})
