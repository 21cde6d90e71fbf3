"""The KV layout spec: every piece of KV state of a model, described once, as data.

Owns `KVLayout`, the component table of each model family (`dsv4_rows`, `hybrid_rows`), the
geometry checks that reject a layout the allocators cannot address, and `build_layout`.
Everything else (capacity solver, pool buffers, budgets, PD manifest, PP slicing, offload)
derives from `KVLayout`. Pure Python, no torch.

A component's rows live in one of three index spaces, fixed by its kind (`PLACEMENT`):

    FULL_PAGE : `rows_per_unit` rows per full page (compressed KV, indexer keys, full-attn KV)
    SWA_PAGE  : `rows_per_unit` rows per SWA page (window KV: one row per token; DSV4 CSA
                compressor rings: one ring per SWA page)
    REQ_SLOT  : `rows_per_unit` rows per request slot (DSV4 HCA compressor rings)

NOTE: one unit (page or request slot) of one layer occupies `unit_bytes` bytes; buffers are
`(num_units + 1) x unit_bytes` per layer, unit 0 being the reserved "none" unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final, Literal, NamedTuple

from dsv4_common.core.model import DTYPE_BYTES, DSV4Config, HybridSWAConfig, ModelConfig

LAYOUT_VERSION = 1
RequestState = Literal["ring", "online"]
REQUEST_STATES: tuple[RequestState, ...] = ("ring", "online")
ONLINE_STATE_ROWS = 3  # running max, running sum, weighted kv (per channel)


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
    REQUEST_ONLINE = "request_online"  # streaming compressor state, one per request (HCA)


# kind -> (index space of its rows, window-bounded: window eviction frees its units).
PLACEMENT: Final[Mapping[ComponentKind, tuple[IndexSpace, bool]]] = {
    ComponentKind.WINDOW_KV: (IndexSpace.SWA_PAGE, True),
    ComponentKind.FULL_KV: (IndexSpace.FULL_PAGE, False),
    ComponentKind.COMPRESSED_KV: (IndexSpace.FULL_PAGE, False),
    ComponentKind.INDEXER_KEYS: (IndexSpace.FULL_PAGE, False),
    ComponentKind.PAGE_RING: (IndexSpace.SWA_PAGE, True),
    ComponentKind.REQUEST_RING: (IndexSpace.REQ_SLOT, False),
    ComponentKind.REQUEST_ONLINE: (IndexSpace.REQ_SLOT, False),
}


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
    request_state: RequestState = "ring"  # the form of the HCA compressors' state
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


class RowStorage(NamedTuple):
    """How one row is stored: `elems` elements of `dtype` ("uint8" for packed fp8 rows)."""

    dtype: str
    elems: int


@dataclass(frozen=True, slots=True)
class ComponentRow:
    """One line of a layout table: a component before its unit bytes are worked out."""

    name: str
    kind: ComponentKind  # also fixes the index space and window-boundedness (`PLACEMENT`)
    layer_ids: tuple[int, ...]  # empty: the component does not exist for this model
    ratio: int  # tokens per row
    storage: RowStorage
    rows_per_unit: int
    align_bytes: int = 1  # a unit's bytes are rounded up to a multiple of this

    def to_component(self) -> Component:
        elem = DTYPE_BYTES[self.storage.dtype]
        unit = _align_up(self.rows_per_unit * self.storage.elems * elem, self.align_bytes)
        assert unit % elem == 0, (
            f"{self.name}: aligned unit of {unit} B is not a whole number of {self.storage.dtype}"
        )
        space, window_bounded = PLACEMENT[self.kind]
        return Component(
            name=self.name,
            kind=self.kind,
            index_space=space,
            layer_ids=self.layer_ids,
            ratio=self.ratio,
            dtype=self.storage.dtype,
            row_elems=self.storage.elems,
            rows_per_unit=self.rows_per_unit,
            unit_bytes=unit,
            window_bounded=window_bounded,
        )


def components_of(rows: Iterable[ComponentRow]) -> tuple[Component, ...]:
    """The table's components, in table order; a row without layers yields none."""
    return tuple(row.to_component() for row in rows if row.layer_ids)


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


# ---------------------------------------------------------------------------------------------
# DSV4


def kv_row_storage(model: DSV4Config) -> RowStorage:
    """One window/compressed KV row.

    fp8_e4m3 packs 448 B fp8 nope + 2 B x 64 bf16 rope + 7 scales (one per 64) + 1 pad = 584 B.
    """
    if model.kv_dtype == "fp8_e4m3":
        scales = -(-model.qk_nope_head_dim // 64)
        raw = model.qk_nope_head_dim + 2 * model.qk_rope_head_dim + scales
        return RowStorage("uint8", _align_up(raw, 8))
    return RowStorage(model.kv_dtype, model.head_dim)


def indexer_row_storage(model: DSV4Config) -> RowStorage:
    """One indexer key row: fp8 128 B + fp32 scale = 132 B."""
    d = model.index_head_dim
    if model.indexer_dtype == "fp8":
        return RowStorage("uint8", d + 4 * (-(-d // 128)))
    if model.indexer_dtype == "fp4":
        return RowStorage("uint8", d // 2 + 4 * (-(-d // 128)))
    return RowStorage(model.indexer_dtype, d)


def ring_rows(model: DSV4Config, ratio: int, speculative: bool) -> int:
    """Compressor ring rows: overlapped CSA keeps 2r pending tokens, HCA r; doubled with spec."""
    base = 2 * ratio if ratio == model.sparse_ratio else ratio
    return base * (2 if speculative else 1)


def ring_draft_tolerance(model: DSV4Config, ratio: int, speculative: bool) -> int:
    """Most draft tokens a ring absorbs before it overwrites rows still pending compression."""
    pending = 2 * ratio if ratio == model.sparse_ratio else ratio
    return ring_rows(model, ratio, speculative) - pending + 2


def ring_name(model: DSV4Config, ratio: int) -> str:
    """The ring component whose rows bound the draft tokens of ratio-r layers."""
    return f"c{ratio}_attn_state" if ratio == model.sparse_ratio else f"c{ratio}_state"


def dsv4_layer_ids(model: DSV4Config, speculative: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(every layer id, the draft layer ids): draft (MTP/NextN) layers follow the target ones,
    and exist only with speculation."""
    n = model.num_hidden_layers
    draft = tuple(range(n, n + model.num_nextn_predict_layers)) if speculative else ()
    return (*range(n), *draft), draft


def dsv4_rows(
    model: DSV4Config, page_size: int, speculative: bool, request_state: RequestState = "ring"
) -> tuple[ComponentRow, ...]:
    """The DSV4 table: a window on every layer; per compression ratio r, its compressed KV,
    then CSA (r == sparse_ratio): indexer keys + per-SWA-page rings, or HCA: a per-request
    state, a ring of the block's pending (kv, score) rows or, online, 3 rows (running max,
    running sum, weighted kv). CSA ring rows: (kv, score) x (previous, current block)."""
    kind = ComponentKind
    kv, indexer = kv_row_storage(model), indexer_row_storage(model)
    attn_state = RowStorage(model.state_dtype, 4 * model.head_dim)
    indexer_state = RowStorage(model.state_dtype, 4 * model.index_head_dim)
    hca_state = RowStorage(model.state_dtype, 2 * model.head_dim)
    online_state = RowStorage(model.state_dtype, model.head_dim)
    align = model.kv_page_align_bytes
    all_ids, _ = dsv4_layer_ids(model, speculative)
    # columns: name, kind, layer ids, ratio, row storage, rows per unit, unit alignment
    rows = [ComponentRow("swa_kv", kind.WINDOW_KV, all_ids, 1, kv, page_size, align)]
    for r in model.nonzero_ratios:
        ids = tuple(i for i, ratio in enumerate(model.target_ratios) if ratio == r)
        ring = ring_rows(model, r, speculative)
        rows.append(ComponentRow(f"c{r}_kv", kind.COMPRESSED_KV, ids, r, kv, page_size // r, align))
        if r == model.sparse_ratio:
            rows += [
                ComponentRow(f"c{r}_indexer", kind.INDEXER_KEYS, ids, r, indexer, page_size // r),
                ComponentRow(f"c{r}_attn_state", kind.PAGE_RING, ids, 1, attn_state, ring),
                ComponentRow(f"c{r}_indexer_state", kind.PAGE_RING, ids, 1, indexer_state, ring),
            ]
        elif request_state == "online":
            rows.append(
                ComponentRow(
                    f"c{r}_state", kind.REQUEST_ONLINE, ids, 1, online_state, ONLINE_STATE_ROWS
                )
            )
        else:
            rows.append(ComponentRow(f"c{r}_state", kind.REQUEST_RING, ids, 1, hca_state, ring))
    return tuple(rows)


def dsv4_draft_tolerance(model: DSV4Config, speculative: bool) -> tuple[tuple[str, int], ...]:
    """(ring component, most draft tokens it tolerates), one per compression ratio."""
    return tuple(
        (ring_name(model, r), ring_draft_tolerance(model, r, speculative))
        for r in model.nonzero_ratios
    )


def check_dsv4_geometry(model: DSV4Config, page_size: int, draft_tokens: int) -> None:
    """Raise LayoutError unless the DSV4 allocators can address this geometry."""
    _check_page_size(page_size, model.nonzero_ratios)
    spec = draft_tokens > 0
    if spec and model.num_nextn_predict_layers < 1:
        raise LayoutError(
            f"speculative_draft_tokens={draft_tokens} needs an MTP/NextN draft layer, "
            f"but {model.name} has num_nextn_predict_layers=0"
        )
    r = model.sparse_ratio
    if r in model.nonzero_ratios and page_size % ring_rows(model, r, spec):
        raise LayoutError(
            f"page_size={page_size} must be a multiple of the c{r} compressor ring "
            f"({ring_rows(model, r, spec)} rows): each SWA page owns one ring, "
            "addressed by slot % ring"
        )
    for r in model.nonzero_ratios:
        allowed = ring_draft_tolerance(model, r, spec)
        if draft_tokens > allowed:
            raise LayoutError(
                f"speculative_draft_tokens={draft_tokens} exceeds what the {ring_name(model, r)} "
                f"ring ({ring_rows(model, r, spec)} rows) tolerates: at most {allowed} draft tokens"
            )


def build_dsv4_layout(
    model: DSV4Config, page_size: int, draft_tokens: int = 0, request_state: RequestState = "ring"
) -> KVLayout:
    check_dsv4_geometry(model, page_size, draft_tokens)
    if request_state == "online" and draft_tokens > 0:
        raise LayoutError(
            f"request_state=online with speculative_draft_tokens={draft_tokens}: a streaming "
            "compressor state cannot roll back rejected draft tokens; use request_state=ring"
        )
    spec = draft_tokens > 0
    all_ids, draft_ids = dsv4_layer_ids(model, spec)
    return KVLayout(
        model_name=model.name,
        page_size=page_size,
        window_tokens=model.window_tokens,
        draft_tokens=draft_tokens,
        components=components_of(dsv4_rows(model, page_size, spec, request_state)),
        layer_ids=all_ids,
        draft_layer_ids=draft_ids,
        draft_tolerance=dsv4_draft_tolerance(model, spec),
        request_state=request_state,
    )


# ---------------------------------------------------------------------------------------------
# Generic hybrid SWA (Gemma / MiMo style)


def hybrid_rows(
    model: HybridSWAConfig, page_size: int, tp_size: int = 1
) -> tuple[ComponentRow, ...]:
    """The hybrid table: full KV on "full" layers, window KV on "sliding" layers; KV heads
    shard by TP, at least one per rank."""
    kv_heads = max(1, model.num_key_value_heads // tp_size)
    kv = RowStorage(model.kv_dtype, kv_heads * (model.head_dim + model.v_head_dim))
    types = model.layer_types
    full_ids = tuple(i for i, t in enumerate(types) if t == "full")
    swa_ids = tuple(i for i, t in enumerate(types) if t == "sliding")
    # columns: name, kind, layer ids, ratio, row storage, rows per unit
    return (
        ComponentRow("full_kv", ComponentKind.FULL_KV, full_ids, 1, kv, page_size),
        ComponentRow("swa_kv", ComponentKind.WINDOW_KV, swa_ids, 1, kv, page_size),
    )


def build_hybrid_layout(
    model: HybridSWAConfig, page_size: int, draft_tokens: int = 0, tp_size: int = 1
) -> KVLayout:
    _check_page_size(page_size, ())
    if draft_tokens > 0:
        raise LayoutError(
            f"speculative_draft_tokens={draft_tokens}: the hybrid-SWA family has no draft layer"
        )
    return KVLayout(
        model_name=model.name,
        page_size=page_size,
        window_tokens=model.window_tokens,
        draft_tokens=0,
        components=components_of(hybrid_rows(model, page_size, tp_size)),
        layer_ids=tuple(range(model.num_hidden_layers)),
        draft_layer_ids=(),
        draft_tolerance=(),
    )


def build_layout(
    model: ModelConfig,
    page_size: int,
    draft_tokens: int = 0,
    tp_size: int = 1,
    request_state: RequestState = "ring",
) -> KVLayout:
    """The one entry point: the full-model layout (select() a PP stage from it).
    `request_state` picks the HCA compressors' state form (DSV4 only)."""
    if draft_tokens < 0:
        raise LayoutError(f"speculative_draft_tokens={draft_tokens} must be >= 0")
    if request_state not in REQUEST_STATES:
        raise LayoutError(f"request_state={request_state!r} must be one of {list(REQUEST_STATES)}")
    if isinstance(model, DSV4Config):
        return build_dsv4_layout(model, page_size, draft_tokens, request_state)
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
