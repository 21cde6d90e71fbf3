"""KVPool: the torch buffers of every layout component of one PP stage. Owns bytes, not indices.

One buffer per component, layer-major so each layer is a contiguous view:

    rows fit the unit exactly : [num_layers, num_units, rows_per_unit, row_elems]  (dtype)
    unit padded (fp8 pages)   : [num_layers, num_units, unit_bytes]              (uint8)

NOTE: `num_units` includes the reserved unit 0 of the component's index space, so
`nbytes == planned_bytes(layout, ...)` exactly (the planner counts unit 0 too).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dsv4_common.core.layout import Component, IndexSpace, KVLayout
from dsv4_common.plan.planner import RankPlan

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "uint8": torch.uint8,
    "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def _is_padded(c: Component) -> bool:
    return c.unit_bytes != c.rows_per_unit * c.row_bytes


class KVPool:
    """Buffers for `layout` with `units[space]` units (unit 0 included) per layer."""

    def __init__(
        self, layout: KVLayout, units: Mapping[IndexSpace, int], device: torch.device | str
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.units = dict(units)
        self._buffers: dict[str, Tensor] = {}
        self._layer_index: dict[str, dict[int, int]] = {}
        for c in layout.components:
            n = self.units[c.index_space]
            if _is_padded(c):
                shape: tuple[int, ...] = (c.num_layers, n, c.unit_bytes)
                dtype = torch.uint8
            else:
                shape, dtype = (
                    (c.num_layers, n, c.rows_per_unit, c.row_elems),
                    TORCH_DTYPES[c.dtype],
                )
            self._buffers[c.name] = torch.zeros(shape, dtype=dtype, device=self.device)
            self._layer_index[c.name] = {lid: i for i, lid in enumerate(c.layer_ids)}

    @classmethod
    def from_rank_plan(cls, rank: RankPlan, device: torch.device | str = "cpu") -> KVPool:
        return cls(rank.layout, rank.pools.units, device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def components(self) -> tuple[Component, ...]:
        return self.layout.components

    def buffer(self, name: str) -> Tensor:
        """All layers of one component; dim 1 is the unit (page / request slot) index."""
        return self._buffers[name]

    def layer(self, name: str, layer_id: int) -> Tensor:
        """The contiguous view of one global layer id of one component."""
        return self._buffers[name][self._layer_index[name][layer_id]]

    def layer_bytes(self, name: str, layer_id: int) -> Tensor:
        """One global layer id of one component as raw bytes: [num_units, unit_bytes] uint8
        (a view, whatever the buffer's dtype)."""
        b = self.layer(name, layer_id)
        return b.view(torch.uint8).reshape(b.shape[0], -1)

    def unit_bytes_view(self, name: str) -> Tensor:
        """The component as raw bytes: [num_layers, num_units, unit_bytes] uint8."""
        b = self._buffers[name]
        return b.view(torch.uint8).reshape(b.shape[0], b.shape[1], -1)

    def clear_units(self, space: IndexSpace, units: Tensor) -> None:
        """Zero units `units` of every component in `space` (all layers)."""
        for c in self.layout.in_space(space):
            self._buffers[c.name].index_fill_(1, units, 0)
