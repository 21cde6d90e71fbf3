"""The KV layout spec: every piece of KV state of a model, described once, as data.

Everything else (capacity solver, pool buffers, budgets, PD manifest, PP slicing, offload)
derives from `KVLayout`. Pure Python, no torch.

A component's rows live in one of three index spaces:

    FULL_PAGE : `rows_per_unit` rows per full page (compressed KV, indexer keys, full-attn KV)
    SWA_PAGE  : `rows_per_unit` rows per SWA page (window KV: one row per token; DSV4 CSA
                compressor rings: one ring per SWA page)
    REQ_SLOT  : `rows_per_unit` rows per request slot (DSV4 HCA compressor rings)

NOTE: one unit (page or request slot) of one layer occupies `unit_bytes` bytes; buffers are
`(num_units + 1) x unit_bytes` per layer, unit 0 being the reserved "none" unit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from dsv4_common.core.model import DTYPE_BYTES, DSV4Config, HybridSWAConfig, ModelConfig

LAYOUT_VERSION = 1


class IndexSpace(StrEnum):
    FULL_PAGE = "full_page"
    SWA_PAGE = "swa_page"
    REQ_SLOT = "req_slot"


class ComponentKind(StrEnum):
    WINDOW_KV = "window_kv"  # raw KV of the last `window` tokens (every DSV4 layer)
    FULL_KV = "full_kv"  # generic full-attention KV (hybrid family)
    COMPRESSED_KV = "compressed_kv"  # one row per `ratio` tokens
    INDEXER_KEYS = "indexer_keys"  # lightning-indexer key per compressed row (CSA layers)
    PAGE_RING = "page_ring"  # compressor state ring, one per SWA page (CSA layers)
    REQUEST_RING = "request_ring"  # compressor state ring, one per request (HCA layers)


class LayoutError(ValueError):
    """A geometry that cannot be addressed; the message names the setting."""


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    kind: ComponentKind
    index_space: IndexSpace
    layer_ids: tuple[int, ...]  # global layer ids (draft layers follow the target layers)
    ratio: int  # tokens per row (1 for window/full KV and rings)
    dtype: str  # storage dtype ("uint8" for packed fp8 rows)
    row_elems: int  # elements of `dtype` per row
    rows_per_unit: int  # rows per page (FULL_PAGE / SWA_PAGE) or per request slot
    unit_bytes: int  # bytes of one unit of one layer (rows x row bytes, then aligned)
    window_bounded: bool  # lives only while its tokens are inside the sliding window

    @property
    def row_bytes(self) -> int:
        return self.row_elems * DTYPE_BYTES[self.dtype]

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def bytes_per_unit_all_layers(self) -> int:
        return self.unit_bytes * self.num_layers


@dataclass(frozen=True, slots=True)
class KVLayout:
    """All components of one model (or one PP stage of it) at one page size."""

    model_name: str
    page_size: int  # tokens per full page == tokens per SWA page
    window_tokens: int
    draft_tokens: int  # speculative draft tokens per step (0 = no speculation)
    components: tuple[Component, ...]
    layer_ids: tuple[int, ...]  # every layer this layout covers (target + draft)
    draft_layer_ids: tuple[int, ...]  # the MTP/NextN draft layers among `layer_ids`
    draft_tolerance: tuple[tuple[str, int], ...]  # (ring component, max draft tokens it allows)
    version: int = LAYOUT_VERSION

    def select(self, layer_ids: Iterable[int]) -> KVLayout:
        """PP slicing: the same layout restricted to `layer_ids` (components may vanish)."""
        keep = frozenset(layer_ids)
        comps = []
        for c in self.components:
            ids = tuple(i for i in c.layer_ids if i in keep)
            if ids:
                comps.append(replace(c, layer_ids=ids))
        names = {c.name for c in comps}
        return replace(
            self,
            components=tuple(comps),
            layer_ids=tuple(i for i in self.layer_ids if i in keep),
            draft_layer_ids=tuple(i for i in self.draft_layer_ids if i in keep),
            draft_tolerance=tuple((n, t) for n, t in self.draft_tolerance if n in names),
        )

    def in_space(self, space: IndexSpace) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.index_space is space)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} in layout of {self.model_name}")

    # Bytes per unit across all layers of this layout: the capacity solver's coefficients.
    @property
    def bytes_per_full_page(self) -> int:
        return sum(c.bytes_per_unit_all_layers for c in self.in_space(IndexSpace.FULL_PAGE))

    @property
    def bytes_per_swa_page(self) -> int:
        return sum(c.bytes_per_unit_all_layers for c in self.in_space(IndexSpace.SWA_PAGE))

    @property
    def bytes_per_request_slot(self) -> int:
        return sum(c.bytes_per_unit_all_layers for c in self.in_space(IndexSpace.REQ_SLOT))

    @property
    def bytes_per_full_token(self) -> float:
        return self.bytes_per_full_page / self.page_size

    @property
    def bytes_per_swa_token(self) -> float:
        return self.bytes_per_swa_page / self.page_size


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _make(
    name: str,
    kind: ComponentKind,
    space: IndexSpace,
    layer_ids: Iterable[int],
    *,
    ratio: int,
    dtype: str,
    row_elems: int,
    rows_per_unit: int,
    window_bounded: bool,
    align_bytes: int = 1,
) -> Component | None:
    ids = tuple(layer_ids)
    if not ids:
        return None
    elem = DTYPE_BYTES[dtype]
    unit = _align_up(rows_per_unit * row_elems * elem, max(align_bytes, 1))
    assert unit % elem == 0, f"{name}: aligned unit of {unit} B is not a whole number of {dtype}"
    return Component(
        name=name,
        kind=kind,
        index_space=space,
        layer_ids=ids,
        ratio=ratio,
        dtype=dtype,
        row_elems=row_elems,
        rows_per_unit=rows_per_unit,
        unit_bytes=unit,
        window_bounded=window_bounded,
    )


# ---------------------------------------------------------------------------------------------
# DSV4


def kv_row_storage(model: DSV4Config) -> tuple[str, int]:
    """(dtype, elements) of one window/compressed KV row.

    fp8_e4m3 packs 448 B fp8 nope + 2 B x 64 bf16 rope + 7 scales (one per 64) + 1 pad = 584 B.
    """
    if model.kv_dtype == "fp8_e4m3":
        scales = -(-model.qk_nope_head_dim // 64)
        raw = model.qk_nope_head_dim + 2 * model.qk_rope_head_dim + scales
        return "uint8", _align_up(raw, 8)
    return model.kv_dtype, model.head_dim


def indexer_row_storage(model: DSV4Config) -> tuple[str, int]:
    """(dtype, elements) of one indexer key row: fp8 128 B + fp32 scale = 132 B."""
    d = model.index_head_dim
    if model.indexer_dtype == "fp8":
        return "uint8", d + 4 * (-(-d // 128))
    if model.indexer_dtype == "fp4":
        return "uint8", d // 2 + 4 * (-(-d // 128))
    return "bf16", d


def ring_rows(model: DSV4Config, ratio: int, speculative: bool) -> int:
    """Compressor ring rows: overlapped CSA keeps 2r pending tokens, HCA r; doubled with spec."""
    base = 2 * ratio if ratio == model.sparse_ratio else ratio
    return base * (2 if speculative else 1)


def ring_draft_tolerance(model: DSV4Config, ratio: int, speculative: bool) -> int:
    """Most draft tokens a ring absorbs before it overwrites rows still pending compression."""
    pending = 2 * ratio if ratio == model.sparse_ratio else ratio
    return ring_rows(model, ratio, speculative) - pending + 2


def build_dsv4_layout(model: DSV4Config, page_size: int, draft_tokens: int = 0) -> KVLayout:
    _check_page_size(page_size, model.nonzero_ratios)
    spec = draft_tokens > 0
    if spec and model.num_nextn_predict_layers < 1:
        raise LayoutError(
            f"speculative_draft_tokens={draft_tokens} needs an MTP/NextN draft layer, "
            f"but {model.name} has num_nextn_predict_layers=0"
        )
    n = model.num_hidden_layers
    ratios = model.target_ratios
    draft_ids = tuple(range(n, n + model.num_nextn_predict_layers)) if spec else ()
    all_ids = tuple(range(n)) + draft_ids
    kv_dtype, kv_elems = kv_row_storage(model)
    idx_dtype, idx_elems = indexer_row_storage(model)
    state = model.state_dtype
    align = model.kv_page_align_bytes
    comps: list[Component | None] = [
        _make(
            "swa_kv",
            ComponentKind.WINDOW_KV,
            IndexSpace.SWA_PAGE,
            all_ids,
            ratio=1,
            dtype=kv_dtype,
            row_elems=kv_elems,
            rows_per_unit=page_size,
            window_bounded=True,
            align_bytes=align,
        ),
    ]
    tolerance: list[tuple[str, int]] = []
    for r in model.nonzero_ratios:
        ids = tuple(i for i in range(n) if ratios[i] == r)
        rows = ring_rows(model, r, spec)
        comps.append(
            _make(
                f"c{r}_kv",
                ComponentKind.COMPRESSED_KV,
                IndexSpace.FULL_PAGE,
                ids,
                ratio=r,
                dtype=kv_dtype,
                row_elems=kv_elems,
                rows_per_unit=page_size // r,
                window_bounded=False,
                align_bytes=align,
            )
        )
        if r == model.sparse_ratio:
            comps.append(
                _make(
                    f"c{r}_indexer",
                    ComponentKind.INDEXER_KEYS,
                    IndexSpace.FULL_PAGE,
                    ids,
                    ratio=r,
                    dtype=idx_dtype,
                    row_elems=idx_elems,
                    rows_per_unit=page_size // r,
                    window_bounded=False,
                )
            )
            # (kv, score) x (previous, current) block: 2 x 2 x dim per pending token.
            comps.append(
                _make(
                    f"c{r}_attn_state",
                    ComponentKind.PAGE_RING,
                    IndexSpace.SWA_PAGE,
                    ids,
                    ratio=1,
                    dtype=state,
                    row_elems=4 * model.head_dim,
                    rows_per_unit=rows,
                    window_bounded=True,
                )
            )
            comps.append(
                _make(
                    f"c{r}_indexer_state",
                    ComponentKind.PAGE_RING,
                    IndexSpace.SWA_PAGE,
                    ids,
                    ratio=1,
                    dtype=state,
                    row_elems=4 * model.index_head_dim,
                    rows_per_unit=rows,
                    window_bounded=True,
                )
            )
            tolerance.append((f"c{r}_attn_state", ring_draft_tolerance(model, r, spec)))
        else:
            comps.append(
                _make(
                    f"c{r}_state",
                    ComponentKind.REQUEST_RING,
                    IndexSpace.REQ_SLOT,
                    ids,
                    ratio=1,
                    dtype=state,
                    row_elems=2 * model.head_dim,
                    rows_per_unit=rows,
                    window_bounded=False,
                )
            )
            tolerance.append((f"c{r}_state", ring_draft_tolerance(model, r, spec)))
        if r == model.sparse_ratio and page_size % rows:
            raise LayoutError(
                f"page_size={page_size} must be a multiple of the c{r} compressor ring "
                f"({rows} rows): each SWA page owns one ring, addressed by slot % ring"
            )
    layout = KVLayout(
        model_name=model.name,
        page_size=page_size,
        window_tokens=model.window_tokens,
        draft_tokens=draft_tokens,
        components=tuple(c for c in comps if c is not None),
        layer_ids=all_ids,
        draft_layer_ids=draft_ids,
        draft_tolerance=tuple(tolerance),
    )
    for name, allowed in layout.draft_tolerance:
        if draft_tokens > allowed:
            rows = layout.component(name).rows_per_unit
            raise LayoutError(
                f"speculative_draft_tokens={draft_tokens} exceeds what the {name} ring "
                f"({rows} rows) tolerates: at most {allowed} draft tokens"
            )
    return layout


# ---------------------------------------------------------------------------------------------
# Generic hybrid SWA (Gemma / MiMo style)


def build_hybrid_layout(
    model: HybridSWAConfig, page_size: int, draft_tokens: int = 0, tp_size: int = 1
) -> KVLayout:
    _check_page_size(page_size, ())
    if draft_tokens > 0:
        raise LayoutError(
            f"speculative_draft_tokens={draft_tokens}: the hybrid-SWA family has no draft layer"
        )
    kv_heads = max(1, model.num_key_value_heads // tp_size)  # heads shard by TP, at least one
    elems = kv_heads * (model.head_dim + model.v_head_dim)
    full_ids = [i for i, t in enumerate(model.layer_types) if t == "full"]
    swa_ids = [i for i, t in enumerate(model.layer_types) if t == "sliding"]
    comps = [
        _make(
            "full_kv",
            ComponentKind.FULL_KV,
            IndexSpace.FULL_PAGE,
            full_ids,
            ratio=1,
            dtype=model.kv_dtype,
            row_elems=elems,
            rows_per_unit=page_size,
            window_bounded=False,
        ),
        _make(
            "swa_kv",
            ComponentKind.WINDOW_KV,
            IndexSpace.SWA_PAGE,
            swa_ids,
            ratio=1,
            dtype=model.kv_dtype,
            row_elems=elems,
            rows_per_unit=page_size,
            window_bounded=True,
        ),
    ]
    return KVLayout(
        model_name=model.name,
        page_size=page_size,
        window_tokens=model.window_tokens,
        draft_tokens=0,
        components=tuple(c for c in comps if c is not None),
        layer_ids=tuple(range(model.num_hidden_layers)),
        draft_layer_ids=(),
        draft_tolerance=(),
    )


def build_layout(
    model: ModelConfig, page_size: int, draft_tokens: int = 0, tp_size: int = 1
) -> KVLayout:
    """The one entry point: the full-model layout (select() a PP stage from it)."""
    if draft_tokens < 0:
        raise LayoutError(f"speculative_draft_tokens={draft_tokens} must be >= 0")
    if isinstance(model, DSV4Config):
        return build_dsv4_layout(model, page_size, draft_tokens)
    return build_hybrid_layout(model, page_size, draft_tokens, tp_size)


def _check_page_size(page_size: int, ratios: tuple[int, ...]) -> None:
    if page_size < 1:
        raise LayoutError(f"page_size={page_size} must be >= 1")
    bad = [r for r in ratios if page_size % r]
    if bad:
        raise LayoutError(
            f"page_size={page_size} must be divisible by every compression ratio {list(ratios)} "
            f"(not by {bad}) so one full page number addresses the compressed pages"
        )
