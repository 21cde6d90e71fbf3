"""A stage's weights hold exactly what the planner counts for its rank (#38 item 2): the shipped
tiny, a release-form FP8/FP4 directory (and its MTP layer when the plan speculates) and a
directory transformers saved, whole and split over PP stages. Nothing is widened at load:
FP8 stays float8_e4m3fn with its E8M0 scales, FP4 experts stay packed, floats keep their dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from checkpoint_writer import release_encode, save_sharded

from dsv4_common.core.hf_dsv4 import release_config
from dsv4_common.core.model import DSV4Config, Quantization
from dsv4_common.core.presets import load_model_config, tiny
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.model.checkpoint import load_checkpoint
from dsv4_worker.model.params import Params
from dsv4_worker.model.stored import FP4Packed, FP8Block
from dsv4_worker.model.weights import init_weights, mtp_param_shapes, stage_param_names
from dsv4_worker.precheck import PACKAGED_MODELS

SPLITS = [(6,), (3, 3), (1, 5)]
RELEASE = Quantization(scale_fmt="ue8m0", expert_dtype="fp4")


def held_per_rank(root: Path, model: DSV4Config, split: tuple[int, ...], draft: bool) -> list[int]:
    """Bytes each PP stage holds after loading its names from `root` (as `dsv4 serve` does)."""
    out, start = [], 0
    for rank, count in enumerate(split):
        layers, last = range(start, start + count), rank == len(split) - 1
        names = stage_param_names(model, layers, first=rank == 0, last=last, draft=draft)
        first = "embed.weight" in names  # the MTP layer reads the embedding too
        ckpt = load_checkpoint(root, model, layers=layers, first=first, last=last, mtp=draft)
        held = {**ckpt.params, **ckpt.mtp}
        assert set(held) == names
        out.append(Params.of(held).nbytes)
        start += count
    return out


def planned_per_rank(model: DSV4Config, split: tuple[int, ...], draft: bool) -> list[int]:
    inputs = PlanInputs(
        model=model,
        role="colocated",
        gpu_memory_bytes=GIB,
        pp_size=len(split),
        layer_split=split,
        speculative_draft_tokens=1 if draft else 0,
    )
    return [r.weight_bytes for r in plan(inputs).ranks]


def _assert_held_is_planned(root: Path, model: DSV4Config, draft: bool = False) -> None:
    for split in SPLITS:
        held = held_per_rank(root, model, split, draft)
        planned = planned_per_rank(model, split, draft)
        print(f"{model.name} split {split} draft={draft}: held {held}, planned {planned}")
        # The issue asks for 1%; the two agree to the byte.
        assert held == planned


def test_the_shipped_tiny_holds_what_the_plan_counts() -> None:
    root = PACKAGED_MODELS / "tiny"
    _assert_held_is_planned(root, load_model_config(str(root)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DSV4Config]:
    """tiny stored as DeepSeek releases its checkpoints (BF16 floats, FP8 linears, FP4
    experts, F32 where the release keeps F32, I64 hash table), with an MTP layer."""
    model = dataclasses.replace(tiny(), quantization=RELEASE, weight_dtype="bf16")
    gen = torch.Generator().manual_seed(1)
    mtp = {n: torch.randn(s, generator=gen) * 0.1 for n, s in mtp_param_shapes(model).items()}
    tensors = init_weights(model, seed=1, dtype=torch.float32) | mtp
    root = tmp_path_factory.mktemp("release")
    save_sharded(root, release_encode(model, tensors), 3, release_config(model))
    parsed = load_model_config(str(root))
    assert isinstance(parsed, DSV4Config)
    assert parsed.quantization == RELEASE and parsed.weight_dtype == "bf16"
    return root, parsed


def test_a_release_form_directory_holds_what_the_plan_counts(
    release_dir: tuple[Path, DSV4Config],
) -> None:
    root, model = release_dir
    _assert_held_is_planned(root, model)


def test_the_mtp_layer_is_held_exactly_when_the_plan_speculates(
    release_dir: tuple[Path, DSV4Config],
) -> None:
    root, model = release_dir
    _assert_held_is_planned(root, model, draft=True)
    without, with_draft = planned_per_rank(model, (6,), False), planned_per_rank(model, (6,), True)
    assert with_draft[0] > without[0]  # the MTP layer is counted (and held) only then


def test_release_storage_is_held_as_stored(release_dir: tuple[Path, DSV4Config]) -> None:
    root, model = release_dir
    held = load_checkpoint(root, model).params
    kinds = {
        type(s).__name__ if not isinstance(s, torch.Tensor) else str(s.dtype) for s in held.values()
    }
    assert kinds == {"FP8Block", "FP4Packed", "torch.bfloat16", "torch.float32", "torch.int64"}
    wq_a = held["layers.1.attn.wq_a.weight"]
    assert isinstance(wq_a, FP8Block) and wq_a.values.dtype == torch.float8_e4m3fn
    assert wq_a.scale.dtype == torch.float8_e8m0fnu
    expert = held["layers.1.ffn.experts.0.w1.weight"]
    assert isinstance(expert, FP4Packed) and expert.packed.dtype == torch.int8
    assert expert.packed.shape == (32, 32) and expert.shape == (32, 64)
    assert held["layers.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16  # type: ignore[union-attr]
    assert held["layers.1.attn.attn_sink"].dtype == torch.float32  # type: ignore[union-attr]


def test_a_directory_transformers_saved_holds_what_the_plan_counts(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hf_support import save_model_dir

    save_model_dir(tiny(), seed=2, root=tmp_path)
    model = load_model_config(str(tmp_path))
    assert isinstance(model, DSV4Config) and model.weight_dtype == "fp32"
    _assert_held_is_planned(tmp_path, model)
