"""greedy_tokens (the engine's batched greedy pick) == torch.argmax row by row, whatever the
path (numpy on CPU float32/64, torch otherwise): the first maximum wins a tie and a NaN counts
as the maximum."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.engine.sampler import greedy_tokens

# Few distinct values, so ties are common; NaN and infinities included.
VALUES = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(1, 9),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_greedy_tokens_equal_torch_argmax(
    rows: int, vocab: int, data: st.DataObject, dtype: torch.dtype
) -> None:
    values = data.draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float64).reshape(rows, vocab).to(dtype)
    want = [int(logits[i].argmax()) for i in range(rows)]
    assert greedy_tokens(logits) == want


def test_a_non_contiguous_batch() -> None:
    logits = torch.randn(8, 16).t()  # a transposed view: numpy takes its strides
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()


@pytest.mark.gpu
def test_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    logits = torch.randn(64, 256, device="cuda")
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
