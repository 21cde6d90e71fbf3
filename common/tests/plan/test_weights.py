"""Weight bytes per PP rank and GPU (`plan/weights.py`): the ranks of any split add up to the
published checkpoint (MTP layers only when speculating), TP splits what the reference splits and
replicates the rest, and `dsv4 plan` reports the same for the published config.json."""

from __future__ import annotations

import json

import pytest
from repo_paths import MODEL_DATA

from dsv4_cli.main import main
from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import deepseek_v4_flash, deepseek_v4_pro, tiny
from dsv4_common.core.tensors import (
    embedding_params,
    head_params,
    layer_params,
    mtp_params,
    stored_tensors,
)
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_common.plan.stages import StageModel
from dsv4_common.plan.weights import estimate_weight_bytes

FLASH_BYTES = 159_609_485_896  # the published index's total_size (test_tensors.py)


def ranks_total(m: DSV4Config, split: list[int], tp: int, with_draft: bool) -> int:
    starts = [sum(split[:i]) for i in range(len(split))]
    return sum(
        estimate_weight_bytes(
            m,
            range(start, start + size),
            first=i == 0,
            last=i == len(split) - 1,
            with_draft=with_draft,
            tp_size=tp,
        )
        for i, (start, size) in enumerate(zip(starts, split, strict=True))
    )


def embedding_bytes(m: DSV4Config) -> int:
    return sum(t.nbytes for t in stored_tensors(m, embedding_params(m)))


@pytest.mark.parametrize("split", [[43], [22, 21], [11, 11, 11, 10], [1, 40, 2]])
def test_ranks_add_up_to_the_published_checkpoint(split: list[int]) -> None:
    flash = deepseek_v4_flash()
    speculating = ranks_total(flash, split, 1, with_draft=True)
    # the MTP layer reads the embedding: a last rank that is not the first holds a copy
    copy = embedding_bytes(flash) if len(split) > 1 else 0
    assert speculating == FLASH_BYTES + copy
    mtp = sum(t.nbytes for t in stored_tensors(flash, mtp_params(flash, 0)))
    assert ranks_total(flash, split, 1, with_draft=False) == FLASH_BYTES - mtp


def test_tp_splits_experts_heads_and_vocabulary_and_replicates_the_rest() -> None:
    flash = deepseek_v4_flash()
    split = {p.name for p in (*embedding_params(flash), *head_params(flash)) if p.split}
    assert split == {"embed.weight", "head.weight"}
    layer = {p.name.removeprefix("layers.2.") for p in layer_params(flash, 2) if p.split}
    assert layer == {
        "attn.wq_b.weight",
        "attn.indexer.wq_b.weight",
        "attn.indexer.weights_proj.weight",
        "attn.wo_a.weight",
        "attn.wo_b.weight",
        "attn.attn_sink",
        "ffn.experts.{e}.w1.weight",
        "ffn.experts.{e}.w2.weight",
        "ffn.experts.{e}.w3.weight",
        "ffn.shared_experts.w1.weight",
        "ffn.shared_experts.w2.weight",
        "ffn.shared_experts.w3.weight",
    }
    for m in (flash, deepseek_v4_pro()):
        layers = range(m.num_hidden_layers)
        whole = estimate_weight_bytes(m, layers, first=True, last=True, with_draft=False, tp_size=1)
        for tp in (2, 4, 8):
            gpu = estimate_weight_bytes(
                m, layers, first=True, last=True, with_draft=False, tp_size=tp
            )
            # replicated (norms, hc, wq_a, wkv, compressors, router): under 1.5% of the model
            assert whole < gpu * tp < whole * (1 + 0.015 * (tp - 1))


def test_stage_model_prices_ranks_as_the_estimate() -> None:
    for m, tp in ((deepseek_v4_pro(), 8), (tiny(), 1)):
        inputs = PlanInputs(
            model=m,
            role="decode",
            gpu_memory_bytes=10**13,
            tp_size=tp,
            pp_size=3,
            speculative_draft_tokens=1,
        )
        p = plan(inputs)
        stages = StageModel(inputs, p.ranks[0].layout)
        for r in p.ranks:
            assert stages.weight_bytes(r.pp_rank, *r.layers) == r.weight_bytes


@pytest.mark.parametrize("form", ["", "-transformers"])
def test_cli_plan_of_the_published_flash_reports_its_weights(
    form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = MODEL_DATA / f"deepseek-v4-flash{form}" / "config.json"
    argv = ["plan", "--model", str(path), "--gpu-memory-gib", "1000", "--json"]
    assert main([*argv, "--speculative-draft-tokens", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["weight_bytes"] for r in doc["ranks"]] == [FLASH_BYTES]
    assert main([*argv, "--pp", "4", "--tp", "8"]) == 0
    per_gpu = [r["weight_bytes"] for r in json.loads(capsys.readouterr().out)["ranks"]]
    assert 150e9 / 8 < sum(per_gpu) < 165e9 / 8 * 1.05
