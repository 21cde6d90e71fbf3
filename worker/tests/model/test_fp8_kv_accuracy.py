"""The release's fp8 KV rows against transformers with float KV (#38 item 4), on a sample small
enough for CI: teacher-forced top-1 agreement >= 97% on the shipped trained tiny model (English
text) and on Flash-shaped layers (random weights, scaled init), the median top-2 margin showing
the logits are not flat. bench/kv_accuracy.py measures >= 2,000 positions over five configs;
the figures are in docs/real-model.md."""

from __future__ import annotations

import pytest
from kv_accuracy_support import CASES, float32_kv, measure

pytest.importorskip("transformers")

THRESHOLD = 0.97


@pytest.mark.parametrize("name", ["tiny-trained", "flash-shaped"])
def test_fp8_kv_agrees_with_transformers_top1(name: str) -> None:
    fp8 = measure(CASES[name], 120)
    assert fp8.median_margin > 0.5  # the reference's logits are peaked, not flat
    assert fp8.agreement >= THRESHOLD, fp8
    assert fp8.max_abs_dlogprob < 1.5, fp8
    # The same engine with float32 rows agrees with transformers everywhere: what differs
    # above is the fp8 rounding of the stored rows. (Not to 1e-5 at every position: where two
    # blocks' indexer scores tie to float32 precision, float32 keys and transformers' float64
    # keys may pick different blocks; docs/real-model.md.)
    f32 = measure(CASES[name], 120, kv=float32_kv)
    assert f32.agree == f32.positions and f32.mean_abs_dlogprob < 1e-3, f32
