"""`cpu_linear`: a few rows times W, W's rows cut into one block per thread and multiplied as
one batched product, equals F.linear (within the rounding of a different kernel) for any shape,
either memory layout of W, any thread count; `parts` splits only where it pays (a CPU, several
threads, few rows, blocks large enough) and only into equal blocks; Params keeps the blocks of
a held weight and forgets them when it replaces the weight."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4_worker.model import cpu_linear
from dsv4_worker.model.cpu_linear import SPLIT_MAX_ROWS, SPLIT_MIN_PART_BYTES, parts
from dsv4_worker.model.params import Params

CPU = torch.device("cpu")
# float32 sums of up to 1024 products of N(0, 1) values, in a different order: a few ulps of
# the largest partial sums
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.integers(0, 40),
    lead=st.sampled_from([(), (1,), (2,)]),
    blocks=st.integers(1, 6),
    block_rows=st.integers(1, 64),
    in_features=st.integers(1, 1024),
    column_major=st.booleans(),
    num_threads=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
@example(1, (), 2, 512, 1024, False, 2, torch.float32, 0)  # a decode step's expert gate
@example(16, (), 2, 4096, 1024, True, 2, torch.float32, 1)  # a head at 16 running
@example(1, (1,), 3, 256, 512, True, 3, torch.float64, 2)
def test_the_split_product_is_the_linear(
    rows: int,
    lead: tuple[int, ...],
    blocks: int,
    block_rows: int,
    in_features: int,
    column_major: bool,
    num_threads: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    out_features = blocks * block_rows
    w = torch.randn(out_features, in_features, generator=gen, dtype=dtype)
    if column_major:
        w = w.t().contiguous().t()
    x = torch.randn(*lead, rows, in_features, generator=gen, dtype=dtype)
    cache: dict[str, torch.Tensor] = {}
    for _ in range(2):  # the second call reads the cached blocks
        with torch_threads(num_threads):
            got = cpu_linear.linear(x, w, cache, "w")
        want = F.linear(x, w)
        assert got.shape == want.shape and got.dtype == dtype
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
        assert torch.allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale)
    split = parts(
        x.numel() // in_features, out_features, w.numel() * w.element_size(), num_threads, CPU
    )
    assert ("w" in cache) == (split > 1)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    rows=st.integers(0, 100),
    out_features=st.integers(1, 10_000),
    in_features=st.integers(1, 10_000),
    threads=st.integers(1, 32),
    cuda=st.booleans(),
)
def test_parts_splits_only_into_equal_blocks_worth_a_thread(
    rows: int, out_features: int, in_features: int, threads: int, cuda: bool
) -> None:
    w_bytes = out_features * in_features * 4
    device = torch.device("cuda" if cuda else "cpu")
    count = parts(rows, out_features, w_bytes, threads, device)
    assert count in (1, threads)
    if count > 1:
        assert not cuda and threads > 1
        assert 0 < rows <= SPLIT_MAX_ROWS
        assert out_features % count == 0
        assert w_bytes // count >= SPLIT_MIN_PART_BYTES
    elif not cuda and threads > 1 and 0 < rows <= SPLIT_MAX_ROWS:
        assert out_features % threads or w_bytes // threads < SPLIT_MIN_PART_BYTES


def test_params_keeps_a_weights_blocks_and_drops_them_when_it_stacks_the_weight() -> None:
    with torch_threads(2):
        _keeps_and_drops_blocks()


def _keeps_and_drops_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    names = ("e0", "e1")
    held = {n: torch.randn(512, 1024, generator=gen) for n in names}
    p = Params(held, torch.float32)
    x = torch.randn(1, 1024, generator=gen)
    want = F.linear(x, held["e0"])
    first = p.linear(x, "e0")
    assert torch.allclose(first, want, atol=1e-4)
    blocks = p._blocks["e0"]
    assert blocks.shape == (2, 1024, 256)
    assert blocks.untyped_storage().data_ptr() == p.held("e0").untyped_storage().data_ptr()
    assert p.stack(names) is not None  # e0 is now a view of the stack: its blocks go
    assert "e0" not in p._blocks
    again = p.linear(x, "e0")
    assert p._blocks["e0"].untyped_storage().data_ptr() == p.held("e0").untyped_storage().data_ptr()
    assert torch.equal(again, first)
