"""Plan -> JSON-able dict and a human table. Pure formatting, no decisions."""

from __future__ import annotations

from typing import Any

from dsv4_common.core.units import GIB, MIB, format_bytes
from dsv4_common.plan.planner import Plan, RankPlan
from dsv4_common.plan.split import BottleneckKey, format_split


def rank_to_dict(r: RankPlan) -> dict[str, Any]:
    c = r.capacity
    return {
        "pp_rank": r.pp_rank,
        "layers": [r.layers[0], r.layers[1]],
        "draft_layers": list(r.layout.draft_layer_ids),
        "bytes_per_full_token": round(r.layout.bytes_per_full_token, 2),
        "bytes_per_swa_token": round(r.layout.bytes_per_swa_token, 2),
        "bytes_per_request": r.layout.bytes_per_request_slot,
        "full_tokens": c.full_tokens,
        "swa_tokens": c.swa_tokens,
        "swa_ratio": round(r.swa_ratio, 6),
        "max_running_requests": c.max_running_requests,
        "max_context_tokens": c.max_context_tokens,
        "weight_bytes": r.weight_bytes,
        "available_kv_bytes": r.available_bytes,
        "planned_kv_bytes": r.pools.kv_bytes,
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


def bottleneck_to_dict(key: BottleneckKey) -> dict[str, int]:
    ctx, running, full = key
    return {"max_context_tokens": ctx, "max_running_requests": running, "full_tokens": full}


def gain(key: BottleneckKey, base: BottleneckKey) -> str:
    """How `key` compares with `base`, in the first term of the order that differs."""
    (ctx, running, full), (base_ctx, base_running, base_full) = key, base
    if ctx != base_ctx:
        return f"{_percent(ctx, base_ctx)} max context"
    if running != base_running:
        return f"{_percent(running, base_running)} running requests"
    return f"{_percent(full, base_full)} full tokens"


def _percent(value: int, base: int) -> str:
    return f"{(value / base - 1) * 100:+.1f}%"


def split_to_dict(p: Plan, balanced: Plan | None = None) -> dict[str, Any]:
    """The layer split, how it was chosen and how it compares with the even split (and, for a
    fixed split, with the `balanced` plan of the same inputs when one is given)."""
    s = p.split
    even_key = s.even_key
    out: dict[str, Any] = {
        "layers_per_rank": list(s.layers_per_rank),
        "mode": s.mode,
        "bottleneck": bottleneck_to_dict(p.bottleneck_key),
        "even": {
            "layers_per_rank": list(s.even),
            "bottleneck": None if even_key is None else bottleneck_to_dict(even_key),
        },
        "gain_over_even": None if even_key is None else gain(p.bottleneck_key, even_key),
    }
    if balanced is not None and s.mode == "fixed":
        out["balanced"] = {
            "layers_per_rank": list(balanced.split.layers_per_rank),
            "bottleneck": bottleneck_to_dict(balanced.bottleneck_key),
            "gain_over_fixed": gain(balanced.bottleneck_key, p.bottleneck_key),
        }
    return out


def split_line(p: Plan, balanced: Plan | None = None) -> str:
    """e.g. `layer split 15/16/15/15 (balanced): bottleneck +2.9% full tokens over the even
    split 16/15/15/15`."""
    s = p.split
    head = f"layer split {format_split(s.layers_per_rank)} ({s.mode})"
    even = f"the even split {format_split(s.even)}"
    if s.even_key is None:
        line = f"{head}: {even} does not fit"
    elif s.layers_per_rank == s.even:
        line = f"{head}: {even} is already the best" if s.mode == "balanced" else f"{head}: {even}"
    else:
        word = "over" if s.mode == "balanced" else "vs"
        line = f"{head}: bottleneck {gain(p.bottleneck_key, s.even_key)} {word} {even}"
    if balanced is not None and s.mode == "fixed":
        best = balanced.split.layers_per_rank
        if best == s.layers_per_rank:
            line += "; the balanced split is the same"
        else:
            line += (
                f"; the balanced split {format_split(best)} would give "
                f"{gain(balanced.bottleneck_key, p.bottleneck_key)}"
            )
    return line


def plan_to_dict(p: Plan, balanced: Plan | None = None) -> dict[str, Any]:
    """`balanced`: the plan of the same inputs without the fixed `layer_split`, if wanted."""
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
        "layer_split": split_to_dict(p, balanced),
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


def format_table(p: Plan, balanced: Plan | None = None) -> str:
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
        c = r.capacity
        cells = (
            str(r.pp_rank) + ("*" if r.pp_rank == p.bottleneck_rank else ""),
            layers,
            f"{r.layout.bytes_per_full_token:,.1f}",
            f"{r.layout.bytes_per_swa_token:,.1f}",
            f"{r.layout.bytes_per_request_slot / MIB:.2f}",
            f"{r.weight_bytes / GIB:.2f}",
            f"{r.pools.kv_bytes / GIB:.2f}",
            f"{c.full_tokens:,}",
            f"{c.swa_tokens:,}",
            f"{r.swa_ratio:.4f}",
            str(c.max_running_requests),
            f"{c.max_context_tokens:,}",
        )
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
    lines.append(
        f"bottleneck rank (*): {p.bottleneck_rank}; group max context {p.max_context_tokens:,} "
        f"tokens, max running requests {p.max_running_requests}"
    )
    if len(p.ranks) > 1:
        lines.append(split_line(p, balanced))
    return "\n".join(lines)
