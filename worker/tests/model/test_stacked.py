"""Experts held as one stack (`stacked.py`, `Params.stack`/`experts`): a selected expert equals
that expert dequantized alone, bit for bit, for every stored kind (plain floats, FP8 blocks with
partial last blocks, packed FP4 with odd widths), any index (repeats included) and any slice;
stacking keeps the bytes held and every per-expert read as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.model import stacked
from dsv4_worker.model.params import Params
from dsv4_worker.model.quant import quantize_fp4, quantize_fp8_block
from dsv4_worker.model.stacked import Stack
from dsv4_worker.model.stored import FP4Packed, FP8Block, Stored, fp8_row_slice

KINDS = ("float32", "bfloat16", "fp8", "fp8-float-scale", "fp4")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _weights(kind: str, num: int, rows: int, cols: int, seed: int) -> list[Stored]:
    gen = torch.Generator().manual_seed(seed)
    out: list[Stored] = []
    for _ in range(num):
        w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.3
        if kind == "fp4":
            out.append(FP4Packed(*quantize_fp4(w), cols))
        elif kind.startswith("fp8"):
            q, s = quantize_fp8_block(w, (8, 16), pow2=kind == "fp8")
            out.append(FP8Block(q, s, (8, 16)))
        else:
            out.append(w.to(DTYPES[kind]))
    return out


def _alone(w: Stored, dtype: torch.dtype) -> torch.Tensor:
    return Params({"w": w}, dtype).dense("w").clone()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(KINDS),
    num=st.integers(1, 6),
    rows=st.integers(1, 20),
    cols=st.integers(1, 40),
    dtype=st.sampled_from(sorted(DTYPES)),
    picks=st.lists(st.integers(0, 5), min_size=1, max_size=9),
    bounds=st.tuples(st.integers(0, 6), st.integers(0, 6)),
)
def test_a_selected_expert_is_that_expert_dequantized_alone(
    kind: str,
    num: int,
    rows: int,
    cols: int,
    dtype: str,
    picks: list[int],
    bounds: tuple[int, int],
) -> None:
    weights = _weights(kind, num, rows, cols, seed=rows * 41 + cols)
    alone = [_alone(w, DTYPES[dtype]) for w in weights]
    stack = Stack.of(weights)
    assert stack is not None and stack.nbytes == sum(w.nbytes for w in weights)
    index = torch.tensor([e % num for e in picks])
    out = torch.full((len(index), rows, cols), float("nan"), dtype=DTYPES[dtype])
    got = stack.select_into(index, out)
    for i, e in enumerate(index.tolist()):
        assert torch.equal(got[i], alone[e])
    lo, hi = sorted(bounds)
    lo, hi = min(lo, num), min(hi, num)
    got = stack.select_into(slice(lo, hi), torch.empty(hi - lo, rows, cols, dtype=DTYPES[dtype]))
    for i in range(hi - lo):
        assert torch.equal(got[i], alone[lo + i])
    for view, want in zip(stack.views(), alone, strict=True):
        assert torch.equal(_alone(view, DTYPES[dtype]), want)


def test_params_hold_the_same_bytes_after_stacking_and_read_each_expert_as_before() -> None:
    names = [f"layers.0.ffn.experts.{e}.w1.weight" for e in range(5)]
    weights = _weights("fp4", 5, 12, 64, seed=3)
    p = Params(dict(zip(names, weights, strict=True)), torch.float32)
    x = torch.randn(3, 64)
    before = [p.linear(x, n).clone() for n in names]
    held = p.nbytes
    stack = p.stack(names)
    assert stack is not None and p.stack(names) is stack  # built once
    assert p.nbytes == held
    for n, want in zip(names, before, strict=True):
        s = p.held(n)
        assert isinstance(s, FP4Packed)
        assert stack.values.untyped_storage().data_ptr() == s.packed.untyped_storage().data_ptr()
        assert torch.equal(p.linear(x, n), want)
    got = p.experts(names, torch.tensor([4, 0, 4]))
    assert got.shape == (3, 12, 64)
    assert torch.equal(got[0], _alone(weights[4], torch.float32))


@pytest.mark.parametrize("case", ["shapes", "kinds", "row-slice"])
def test_weights_that_cannot_share_a_stack_are_refused_and_kept(case: str) -> None:
    a, b = _weights("fp8", 2, 16, 32, seed=1)
    assert isinstance(a, FP8Block)
    if case == "shapes":
        b = _weights("fp8", 1, 8, 32, seed=2)[0]
    elif case == "kinds":
        b = _weights("fp4", 1, 16, 32, seed=2)[0]
    else:
        a, b = fp8_row_slice(a, 0, 12), fp8_row_slice(a, 4, 16)
    assert Stack.of([a, b]) is None
    p = Params({"a": a, "b": b}, torch.float32)
    assert p.stack(["a", "b"]) is None
    assert p.held("a") is a and p.held("b") is b
    with pytest.raises(ValueError, match="cannot be stacked"):
        p.experts(["a", "b"], slice(0, 2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("piece", [1, 2, 3])
def test_a_cpu_dequantizes_a_selection_in_pieces_to_the_same_values(
    kind: str, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`CPU_PIECE_VALUES` bounds a CPU's dequantization temporaries: any piece size (here 1-3
    experts, against 7 selected) gives the values the whole selection gives."""
    rows, cols = 9, 40
    weights = _weights(kind, 5, rows, cols, seed=piece)
    stack = Stack.of(weights)
    assert stack is not None
    index = torch.tensor([4, 0, 2, 2, 1, 3, 0])
    monkeypatch.setattr(stacked, "CPU_PIECE_VALUES", piece * rows * cols)
    got = stack.select_into(index, torch.empty(7, rows, cols))
    by_slice = stack.select_into(slice(1, 5), torch.empty(4, rows, cols))
    for i, e in enumerate(index.tolist()):
        assert torch.equal(got[i], _alone(weights[e], torch.float32))
    for i in range(4):
        assert torch.equal(by_slice[i], _alone(weights[1 + i], torch.float32))
