"""The release's fp8 KV rows against transformers (#38 item 4), shared by
test_fp8_kv_accuracy.py and bench/kv_accuracy.py (`import kv_accuracy_support`).

Teacher-forced: one fixed token sequence per config; at every position, our paged engine
(chunked prefill, pools in the model's `kv_cache_dtype`, the default CPU compute dtype,
float32) and
transformers 5.24's DeepseekV4ForCausalLM (float64, float KV: it keeps no quantized cache) on
the same dequantized weights each give the next-token distribution. Figures: top-1 agreement,
|logprob difference| of the sequence's next token, and how peaked the reference is (the
median gap between its two best logits), so agreement on flat logits cannot pass for accuracy.

Logits are not flat: the random configs draw transformers' lm_head with gain 4
(hf_support.hf_model: logits with a standard deviation of ~4) and the output projection of
every residual branch (attention's wo_b, the experts' and shared experts' w2) with GPT-2's
scaled init, std / sqrt(2 x layers), so the residual stream dominates each layer's update as
in a trained network (`branch_scale`; 1.0 gives hf_model's plain draw, far more sensitive:
docs/real-model.md has both); `tiny-trained` is the shipped tiny model, trained on English
text, fed English text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hf_support import hf_model, load_into_hf, published_params
from release_support import fp8_kv, shaped_layers

from dsv4_common.core.model import DSV4Arch, DSV4Config, WeightShape
from dsv4_common.core.presets import tiny
from dsv4_common.core.units import MIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.engine.paged import PagedModel, Segment
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.checkpoint import load_checkpoint
from dsv4_worker.model.compute import compute_dtype
from dsv4_worker.model.params import Params

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DTYPE = compute_dtype("auto", "cpu")  # what a CPU worker computes in (float32)
# English in the register of the licenses the tiny model was trained on (written here, 700 B).
TEXT = (
    b"Permission is hereby granted to any person obtaining a copy of this software and the "
    b"associated documentation files to deal in the software without restriction, including "
    b"the rights to use, copy, modify, merge, publish and distribute copies of the software, "
    b"subject to the following conditions. The above copyright notice and this permission "
    b"notice shall be included in all copies or substantial portions of the software. You may "
    b"convey a work based on the Program, or the modifications to produce it from the Program, "
    b"in the form of source code, provided that you also meet all of these conditions: the "
    b"work must carry prominent notices stating that you modified it, and giving a relevant "
    b"date. The Library is distributed in the hope that it will be useful, but without any "
    b"warranty; without even the implied warranty of merchantability or fitness for a purpose."
)


@dataclass(frozen=True)
class Case:
    name: str
    model: DSV4Config  # with fp8 KV rows
    page: int
    seed: int


def mixed() -> DSV4Config:
    """A third KV shape: 64 + 64 heads, 64-wide indexer keys, c4 and c128, window 32."""
    return DSV4Config(
        name="mixed",
        num_hidden_layers=4,
        compress_ratios=(4, 128, 0, 4, 0),
        num_nextn_predict_layers=1,
        window_tokens=32,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        index_head_dim=64,
        index_n_heads=16,
        index_topk=12,
        kv_dtype="fp32",
        indexer_dtype="fp32",
        state_dtype="fp32",
        weights=WeightShape(
            hidden_size=64,
            vocab_size=200,
            num_attention_heads=4,
            intermediate_size=0,
            num_routed_experts=4,
            num_shared_experts=1,
            moe_intermediate_size=32,
            num_experts_per_token=2,
            q_lora_rank=32,
            o_lora_rank=16,
        ),
        max_position_embeddings=4096,
        arch=DSV4Arch(hc_mult=2, o_groups=2, num_hash_layers=1, scoring_func="sigmoid"),
    )


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("flash-shaped", fp8_kv(shaped_layers("flash")), 256, 1),
        Case("pro-shaped", fp8_kv(shaped_layers("pro")), 256, 2),
        Case("tiny-random", fp8_kv(tiny()), 16, 3),
        Case("mixed", fp8_kv(mixed()), 128, 4),
        Case("tiny-trained", fp8_kv(tiny()), 16, 0),
    )
}


@dataclass(frozen=True)
class Figures:
    """One config's comparison at `positions` positions."""

    name: str
    positions: int
    agree: int  # positions where both argmaxes are the same token
    mean_abs_dlogprob: float  # |our - reference logprob| of the next token in the sequence
    max_abs_dlogprob: float
    median_margin: float  # the reference's median gap between its best two logits

    @property
    def agreement(self) -> float:
        return self.agree / self.positions


BRANCH_OUTPUTS = re.compile(r"^layers\.\d+\.(attn\.wo_b|ffn\..*w2)\.weight$")


def gpt2_branch_scale(model: DSV4Config) -> float:
    return 1.0 / math.sqrt(2 * model.num_hidden_layers)


def weights_and_tokens(
    case: Case, length: int, branch_scale: float | None = None
) -> tuple[Any, dict[str, torch.Tensor], list[int]]:
    """transformers' model holding the case's weights (the shipped checkpoint, or random as
    hf_support draws them), those weights under the published names, and the case's tokens
    (English bytes, or uniform random ids). Random branch outputs are multiplied by
    `branch_scale` (default: GPT-2's)."""
    hf = hf_model(case.model, case.seed)
    if case.name == "tiny-trained":
        assert length <= len(TEXT), f"the text has {len(TEXT)} bytes"
        params = dict(load_checkpoint(ROOT / "worker/dsv4_worker/models/tiny", case.model).params)
        load_into_hf(hf, params)
        return hf, params, list(TEXT[:length])
    gen = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, case.model.weights.vocab_size, (length,), generator=gen).tolist()
    scale = gpt2_branch_scale(case.model) if branch_scale is None else branch_scale
    params = published_params(hf)
    params = {n: t * scale if BRANCH_OUTPUTS.match(n) else t for n, t in params.items()}
    load_into_hf(hf, params)
    return hf, params, ids


def paged_logits(pm: PagedModel, ids: list[int], chunk: int) -> torch.Tensor:
    """Our logits at every position [len(ids), vocab]: chunked prefill of one request."""
    mem = pm.memory
    slot = mem.open(1)
    rows = []
    try:
        for start in range(0, len(ids), chunk):
            part = tuple(ids[start : start + chunk])
            mem.pages.extend(slot, torch.tensor([len(part)]))
            rows.append(pm.forward([Segment(int(slot[0]), start, part)], every=[True]))
            mem.pages.evict_window()
    finally:
        mem.free(slot)
    return torch.cat(rows).to(torch.float64)


def compare(name: str, ours: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> Figures:
    agree = int((ours.argmax(-1) == ref.argmax(-1)).sum())
    target = torch.tensor(ids[1:])[:, None]
    ours_lp = torch.log_softmax(ours[:-1], -1).gather(1, target)
    ref_lp = torch.log_softmax(ref[:-1], -1).gather(1, target)
    diff = (ours_lp - ref_lp).abs()
    top2 = ref.topk(2, dim=-1).values
    return Figures(
        name=name,
        positions=len(ids),
        agree=agree,
        mean_abs_dlogprob=float(diff.mean()),
        max_abs_dlogprob=float(diff.max()),
        median_margin=float((top2[:, 0] - top2[:, 1]).median()),
    )


def measure(
    case: Case,
    length: int,
    chunk: int = 128,
    kv: Callable[[DSV4Config], DSV4Config] | None = None,
    branch_scale: float | None = None,
    dtype: torch.dtype = DEFAULT_DTYPE,
) -> Figures:
    """`case` at `length` positions, ours computing in `dtype`; `kv` may change the model's
    KV storage (e.g. float32 rows, to separate what fp8 costs from what the engines differ by
    otherwise)."""
    model = kv(case.model) if kv is not None else case.model
    hf, params, ids = weights_and_tokens(case, length, branch_scale)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    rank = plan(
        PlanInputs(
            model=model,
            role="colocated",
            gpu_memory_bytes=96 * MIB,  # one request: room for float32 rows of 4 Flash layers
            page_size=case.page,
            max_running_requests=1,
        )
    ).ranks[0]
    pm = PagedModel(model, Params.of(params, dtype), KVMemory.from_rank_plan(rank))
    return compare(case.name, paged_logits(pm, ids, chunk), ref, ids)


def float32_kv(model: DSV4Config) -> DSV4Config:
    return dataclasses.replace(model, kv_dtype="fp32", indexer_dtype="fp32", kv_page_align_bytes=1)
