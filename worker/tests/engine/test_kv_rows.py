"""Rows in the pools as they are stored (engine/kv_rows.py): a quantized component's unit is
FlashMLA's fp8 page (every row's 576 data bytes, then every row's 8 scale bytes, then zero
padding to the 576-byte page alignment) or SGLang's indexer page (128 B keys, then 4 B
scales); a write touches only its rows' bytes; a read returns what `round_trip` returns."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_common.core.layout import Component, IndexSpace, build_layout
from dsv4_common.core.presets import deepseek_v4_flash, tiny
from dsv4_worker.engine.kv_rows import ComponentRows
from dsv4_worker.mem.pool import KVPool
from dsv4_worker.model.kv_quant import IndexerFp8, KVFp8, round_trip, row_format

PAGE = 256  # SGLang's DSV4 page
UNITS = {IndexSpace.FULL_PAGE: 3, IndexSpace.SWA_PAGE: 3, IndexSpace.REQ_SLOT: 2}


def flash_pool() -> KVPool:
    m = deepseek_v4_flash()
    return KVPool(build_layout(m, PAGE).select([2, 3]), UNITS, "cpu")


def bind(pool: KVPool, name: str) -> tuple[ComponentRows, Component]:
    c = pool.layout.component(name)
    return ComponentRows(pool, c, row_format(deepseek_v4_flash(), c.kind)), c


def values(n: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=gen, dtype=torch.float64) * 2


@pytest.mark.parametrize("name", ["swa_kv", "c4_kv", "c128_kv", "c4_indexer"])
def test_rows_read_back_as_their_round_trip(name: str) -> None:
    pool = flash_pool()
    rows, c = bind(pool, name)
    assert rows.fmt is not None
    dim = 512 if isinstance(rows.fmt, KVFp8) else 128
    per_unit = c.rows_per_unit
    index = torch.tensor([per_unit + 0, 2 * per_unit - 1, 2 * per_unit + per_unit // 2])
    layer = c.layer_ids[-1]
    x = values(3, dim, 0)
    rows.write(layer, index, x)
    got = rows.read(layer, index.view(3, 1), torch.float64)
    assert got.shape == (3, 1, dim)
    assert torch.equal(got[:, 0], round_trip(rows.fmt, x))
    other = c.layer_ids[0]
    if other != layer:  # another layer's bytes are untouched
        assert not pool.layer_bytes(name, other).any()


def test_an_fp8_kv_page_is_the_flashmla_layout() -> None:
    pool = flash_pool()
    rows, c = bind(pool, "swa_kv")
    assert c.unit_bytes == -(-PAGE * 584 // 576) * 576
    fmt = KVFp8(448, 64)
    x = values(2, 512, 1)
    unit, slots = 2, (5, 200)
    rows.write(3, torch.tensor([unit * PAGE + s for s in slots]), x)
    page = pool.layer_bytes("swa_kv", 3)[unit]
    data, side = fmt.encode(x)
    written = torch.zeros(c.unit_bytes, dtype=torch.bool)
    for i, s in enumerate(slots):
        assert torch.equal(page[s * 576 : (s + 1) * 576], data[i])
        assert torch.equal(page[PAGE * 576 + s * 8 : PAGE * 576 + (s + 1) * 8], side[i])
        written[s * 576 : (s + 1) * 576] = True
        written[PAGE * 576 + s * 8 : PAGE * 576 + (s + 1) * 8] = True
    assert not page[~written].any()  # other rows, the padding and other units stay zero
    assert not pool.layer_bytes("swa_kv", 3)[:unit].any()


def test_an_fp8_indexer_page_is_keys_then_scales() -> None:
    pool = flash_pool()
    rows, c = bind(pool, "c4_indexer")
    per_unit = PAGE // 4
    assert c.unit_bytes == per_unit * 132
    x = values(1, 128, 2)
    rows.write(2, torch.tensor([per_unit + 7]), x)
    page = pool.layer_bytes("c4_indexer", 2)[1]
    data, side = IndexerFp8(128).encode(x)
    assert torch.equal(page[7 * 128 : 8 * 128], data[0])
    assert torch.equal(page[per_unit * 128 + 7 * 4 : per_unit * 128 + 8 * 4], side[0])
    assert int(page.count_nonzero()) == int(data.count_nonzero() + side.count_nonzero())


def test_plain_rows_are_written_and_read_in_place() -> None:
    m = tiny()
    pool = KVPool(build_layout(m, 16), UNITS, "cpu")
    c = pool.layout.component("swa_kv")
    rows = ComponentRows(pool, c, row_format(m, c.kind))
    assert rows.fmt is None
    x = values(2, m.head_dim, 3)
    rows.write(1, torch.tensor([3, 20]), x)
    assert torch.equal(pool.layer("swa_kv", 1)[1, 4], x[1].float())
    assert torch.equal(rows.read(1, torch.tensor([3, 20]), torch.float64), x.float().double())


def test_float_rows_in_padded_units_are_refused() -> None:
    m = dataclasses.replace(tiny(), kv_page_align_bytes=96)
    pool = KVPool(build_layout(m, 16), UNITS, "cpu")
    with pytest.raises(ValueError, match="swa_kv: fp32 rows in padded units"):
        ComponentRows(pool, pool.layout.component("swa_kv"), None)


def test_a_format_the_layout_does_not_count_is_refused() -> None:
    pool = flash_pool()
    c = pool.layout.component("swa_kv")
    wrong = dataclasses.replace(c, row_elems=576)
    with pytest.raises(ValueError, match="the layout counts 576 B"):
        ComponentRows(pool, wrong, KVFp8(448, 64))
