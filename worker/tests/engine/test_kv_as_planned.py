"""KV rows as planned (#38 item 3), for `tiny` (fp32 rows), a directory in the release's form
(fp8 rows because its config has `quantization_config`) and Flash- and Pro-shaped layers
(the real KV dimensions, random weights): every pool's bytes per full token, per SWA token
and per request equal the planner's figures exactly, and the paged engine serves from those
pools, fp8 rows quantized on write and dequantized on gather, giving the naive oracle's
greedy tokens (the oracle rounds every stored row through the same format)."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from paged_helpers import generate, make
from release_support import release_model, shaped_layers, write_release_dir

from dsv4_common.core.layout import ComponentKind, IndexSpace
from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import load_model_config, tiny
from dsv4_worker.model.checkpoint import load_checkpoint
from dsv4_worker.model.kv_quant import row_format
from dsv4_worker.model.oracle import oracle_greedy
from dsv4_worker.model.weights import init_weights

PAGE = {"tiny": 16, "release": 16, "flash": 256, "pro": 256}


def _released(tmp: Path) -> tuple[DSV4Config, dict[str, torch.Tensor]]:
    write_release_dir(tmp, release_model(), seed=3)
    model = load_model_config(str(tmp))
    assert isinstance(model, DSV4Config)
    return model, load_checkpoint(tmp, model).params


def _random(model: DSV4Config) -> Callable[[Path], tuple[DSV4Config, dict[str, torch.Tensor]]]:
    return lambda _: (model, init_weights(model, seed=11))


CASES = {
    "tiny": _random(tiny()),
    "release": _released,
    "flash": _random(shaped_layers("flash")),
    "pro": _random(shaped_layers("pro")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_pool_holds_the_planned_bytes_per_token(case: str, tmp_path: Path) -> None:
    model, weights = CASES[case](tmp_path)
    pm = make(model, PAGE[case], weights=weights)  # binds every KV component to its format
    pool, layout = pm.pool, pm.memory.layout
    for c in layout.components:
        units = pool.units[c.index_space]
        assert pool.buffer(c.name).nbytes == c.num_layers * units * c.unit_bytes, c.name

    def measured(space: IndexSpace) -> int:
        """Bytes per unit of `space`, summed over every layer of its components, read off
        the buffers the worker allocated."""
        comps = layout.in_space(space)
        return sum(pool.buffer(c.name).nbytes // pool.units[space] for c in comps)

    assert measured(IndexSpace.FULL_PAGE) == layout.bytes_per_full_page
    assert measured(IndexSpace.SWA_PAGE) == layout.bytes_per_swa_page
    assert measured(IndexSpace.REQ_SLOT) == layout.bytes_per_request_slot
    full_token = Fraction(measured(IndexSpace.FULL_PAGE), layout.page_size)
    swa_token = Fraction(measured(IndexSpace.SWA_PAGE), layout.page_size)
    assert float(full_token) == layout.bytes_per_full_token
    assert float(swa_token) == layout.bytes_per_swa_token
    fp8 = model.kv_dtype == "fp8_e4m3"
    assert fp8 == (case != "tiny")
    for c in layout.components:
        fmt = row_format(model, c.kind)
        if c.kind in (ComponentKind.WINDOW_KV, ComponentKind.COMPRESSED_KV):
            want = model.qk_nope_head_dim + 2 * model.qk_rope_head_dim + 8 if fp8 else None
        elif c.kind is ComponentKind.INDEXER_KEYS:
            want = model.index_head_dim + 4 if fp8 else None
        else:
            continue
        assert (None if fmt is None else fmt.data_bytes + fmt.side_bytes) == want
        if fp8:
            assert c.row_bytes == want
            align = 576 if c.kind is not ComponentKind.INDEXER_KEYS else 1
            assert c.unit_bytes == -(-c.rows_per_unit * want // align) * align
    if case in ("flash", "pro"):
        assert layout.component("swa_kv").row_bytes == 584
        assert layout.component("c4_indexer").row_bytes == 132


def _prompt(n: int, salt: int) -> list[int]:
    return [((37 * i + 11 * salt) % 250) + 3 for i in range(n)]


@pytest.mark.parametrize("case", ["release", "flash", "pro"])
def test_fp8_pools_give_the_oracle_greedy_tokens(case: str, tmp_path: Path) -> None:
    """Chunked prefill of two prompts together (one past the window and a c128 block),
    then decode; pages hold 256 tokens as SGLang's DSV4 pages do (16 for the tiny release)."""
    model, weights = CASES[case](tmp_path)
    pm = make(model, PAGE[case], weights=weights)
    long = 200 if case != "release" else 70
    prompts = [_prompt(long, 1), _prompt(41, 2)]
    got = generate(pm, prompts, 96, 3)
    assert got == [oracle_greedy(model, weights, p, 3) for p in prompts]
    # The window rows went in as fp8 pages: per unit, R rows of 576 data bytes, then R x 8
    # scale bytes whose pad byte stays 0, then the page padding, never written.
    swa = pm.memory.layout.component("swa_kv")
    rows, fmt = swa.rows_per_unit, row_format(model, ComponentKind.WINDOW_KV)
    assert fmt is not None
    units = pm.pool.layer_bytes("swa_kv", 0)
    side = units[:, rows * fmt.data_bytes : rows * swa.row_bytes].reshape(-1, rows, 8)
    assert bool(side[..., :7].any()) and not bool(side[..., 7].any())
    assert not bool(units[:, rows * swa.row_bytes :].any())
