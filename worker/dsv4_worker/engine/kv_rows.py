"""One KV component's rows in its pool, in their stored format: `write` stores float rows
(quantizing them where the format says so), `read` gathers rows and returns them as floats.
Row i of a layer is row i % R of unit i // R (R = rows per unit), the flat row index
engine/paged.py computes for every component.

Within one unit of a quantized component (FlashMLA's fp8 KV page, SGLang's indexer page):

    [ R x data_bytes | R x side_bytes (scales) | zero pad up to unit_bytes ]

Plain float rows (fp32 / bf16 pools) lie back to back and are indexed in place.

NOTE: the bytes are exactly what the planner counts (`data_bytes + side_bytes` ==
`Component.row_bytes`, checked when a component is bound), so PD transfer, PP and CPU
offload move them as opaque units.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4_common.core.layout import Component
from dsv4_worker.mem.pool import TORCH_DTYPES, KVPool
from dsv4_worker.model.kv_quant import RowFormat


class ComponentRows:
    """Read and write access to the rows of one component (every layer the pool holds)."""

    def __init__(self, pool: KVPool, component: Component, fmt: RowFormat | None) -> None:
        if fmt is not None and fmt.data_bytes + fmt.side_bytes != component.row_bytes:
            raise ValueError(
                f"{component.name}: a stored row is {fmt.data_bytes} + {fmt.side_bytes} B, "
                f"the layout counts {component.row_bytes} B"
            )
        if fmt is None and pool.buffer(component.name).dtype != TORCH_DTYPES[component.dtype]:
            raise ValueError(
                f"{component.name}: {component.dtype} rows in padded units (kv_page_align_bytes "
                "> 1) are not supported; the alignment is for fp8 rows"
            )
        self.pool = pool
        self.component = component
        self.fmt = fmt
        self._views: dict[int, tuple[Tensor, Tensor]] = {}

    def write(self, layer: int, rows: Tensor, values: Tensor) -> None:
        """Store `values` [N, dim] at flat row indices `rows` [N] of global layer `layer`."""
        if self.fmt is None:
            plain = self._plain(layer)
            plain[rows] = values.to(plain.dtype)
            return
        data, side = self._quantized(layer)
        unit, row = self._split(rows)
        encoded_data, encoded_side = self.fmt.encode(values)
        data[unit, row] = encoded_data
        side[unit, row] = encoded_side

    def read(self, layer: int, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """The rows at flat indices `rows` (any shape) as `dtype`: [*rows.shape, dim]."""
        if self.fmt is None:
            return self._plain(layer)[rows].to(dtype)
        data, side = self._quantized(layer)
        unit, row = self._split(rows.reshape(-1))
        values = self.fmt.decode(data[unit, row], side[unit, row], dtype)
        return values.view(*rows.shape, values.shape[-1])

    def _split(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        per_unit = self.component.rows_per_unit
        return rows // per_unit, rows % per_unit

    def _plain(self, layer: int) -> Tensor:
        view = self.pool.layer(self.component.name, layer)
        return view.view(-1, view.shape[-1])

    def _quantized(self, layer: int) -> tuple[Tensor, Tensor]:
        """(data [units, R, data_bytes], side [units, R, side_bytes]) views of one layer."""
        views = self._views.get(layer)
        if views is None:
            assert self.fmt is not None
            units = self.pool.layer_bytes(self.component.name, layer)
            r, d, s = self.component.rows_per_unit, self.fmt.data_bytes, self.fmt.side_bytes
            n = units.shape[0]
            data = units[:, : r * d].view(n, r, d)
            side = units[:, r * d : r * (d + s)].view(n, r, s)
            views = self._views[layer] = (data, side)
        return views
