"""Plan -> JSON-able dict and a human table. Pure formatting, no decisions."""

from __future__ import annotations

from typing import Any

from dsv4_common.core.units import GIB, MIB, format_bytes
from dsv4_common.plan.planner import Plan, RankPlan


def rank_to_dict(r: RankPlan) -> dict[str, Any]:
    return {
        "pp_rank": r.pp_rank,
        "layers": [r.layers[0], r.layers[1]],
        "draft_layers": list(r.layout.draft_layer_ids),
        "bytes_per_full_token": round(r.layout.bytes_per_full_token, 2),
        "bytes_per_swa_token": round(r.layout.bytes_per_swa_token, 2),
        "bytes_per_request": r.layout.bytes_per_request_slot,
        "full_tokens": r.full_tokens,
        "swa_tokens": r.swa_tokens,
        "swa_ratio": round(r.swa_ratio, 6),
        "max_running_requests": r.max_running_requests,
        "max_context_tokens": r.max_context_tokens,
        "weight_bytes": r.weight_bytes,
        "available_kv_bytes": r.available_bytes,
        "planned_kv_bytes": r.capacity.kv_bytes,
        "swa_pages_per_request": r.swa_need.pages_per_request,
        "components": {
            c.name: {
                "index_space": c.index_space.value,
                "layers": len(c.layer_ids),
                "units_per_layer": units,
                "rows_per_layer": units * c.rows_per_unit,
                "unit_bytes": c.unit_bytes,
                "bytes": units * c.bytes_per_unit_all_layers,
            }
            for c, units in zip(r.layout.components, r.component_units().values(), strict=True)
        },
    }


def plan_to_dict(p: Plan) -> dict[str, Any]:
    i = p.inputs
    return {
        "model": i.model.name,
        "role": i.role,
        "pp_size": i.pp_size,
        "tp_size": i.tp_size,
        "page_size": i.resolved_page_size,
        "speculative_draft_tokens": i.speculative_draft_tokens,
        "gpu_memory_bytes": i.gpu_memory_bytes,
        "mem_fraction": i.mem_fraction,
        "ranks": [rank_to_dict(r) for r in p.ranks],
        "bottleneck_rank": p.bottleneck_rank,
        "max_context_tokens": p.max_context_tokens,
        "max_running_requests": p.max_running_requests,
    }


_COLUMNS = (
    ("rank", 4),
    ("layers", 9),
    ("B/full tok", 10),
    ("B/swa tok", 10),
    ("MiB/req", 8),
    ("weights GiB", 11),
    ("KV GiB", 7),
    ("full tokens", 12),
    ("swa tokens", 11),
    ("swa ratio", 9),
    ("max reqs", 8),
    ("max context", 11),
)


def format_table(p: Plan) -> str:
    i = p.inputs
    head = (
        f"{i.model.name}  role={i.role}  PP={i.pp_size}  TP={i.tp_size}  "
        f"page={i.resolved_page_size}  draft={i.speculative_draft_tokens}  "
        f"gpu={format_bytes(i.gpu_memory_bytes)} x {i.mem_fraction}"
    )
    lines = [head, "  ".join(name.rjust(width) for name, width in _COLUMNS)]
    for r in p.ranks:
        start, end = r.layers
        layers = f"{start}-{end - 1}" + ("+d" if r.layout.draft_layer_ids else "")
        cells = (
            str(r.pp_rank) + ("*" if r.pp_rank == p.bottleneck_rank else ""),
            layers,
            f"{r.layout.bytes_per_full_token:,.1f}",
            f"{r.layout.bytes_per_swa_token:,.1f}",
            f"{r.layout.bytes_per_request_slot / MIB:.2f}",
            f"{r.weight_bytes / GIB:.2f}",
            f"{r.capacity.kv_bytes / GIB:.2f}",
            f"{r.full_tokens:,}",
            f"{r.swa_tokens:,}",
            f"{r.swa_ratio:.4f}",
            str(r.max_running_requests),
            f"{r.max_context_tokens:,}",
        )
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
    lines.append(
        f"bottleneck rank (*): {p.bottleneck_rank}; group max context {p.max_context_tokens:,} "
        f"tokens, max running requests {p.max_running_requests}"
    )
    return "\n".join(lines)
