"""The HCA compressor state per request: a ring of the block's pending rows, or the exact
online form (3 rows), selectable in the layout and priced by the planner."""

from __future__ import annotations

import pytest

from dsv4_common.core.gpus import GPU_TYPES
from dsv4_common.core.layout import IndexSpace, LayoutError, build_layout
from dsv4_common.core.presets import deepseek_v4_pro, hybrid_tiny, tiny
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan


def test_online_state_is_three_rows_of_head_dim_per_request() -> None:
    ring = build_layout(deepseek_v4_pro(), 256)
    online = build_layout(deepseek_v4_pro(), 256, request_state="online")
    assert (ring.request_state, online.request_state) == ("ring", "online")
    ring_c, online_c = ring.component("c128_state"), online.component("c128_state")
    assert online_c.index_space is IndexSpace.REQ_SLOT and len(online_c.layer_ids) == 31
    # ring: 128 rows x (kv, score) x 512 fp32; online: (max, sum, kv) x 512 fp32
    assert ring_c.unit_bytes == 128 * 2 * 512 * 4 and online_c.unit_bytes == 3 * 512 * 4
    assert ring.bytes_per_request_slot == 31 * 524_288  # 15.5 MiB
    assert online.bytes_per_request_slot == 31 * 6_144
    # Everything else is unchanged.
    others = [c for c in ring.components if c.name != "c128_state"]
    assert others == [c for c in online.components if c.name != "c128_state"]


def test_online_state_refuses_speculation() -> None:
    with pytest.raises(LayoutError, match="cannot roll back rejected draft tokens"):
        build_layout(deepseek_v4_pro(), 256, draft_tokens=1, request_state="online")


def test_hybrid_models_have_no_request_state_either_way() -> None:
    assert build_layout(hybrid_tiny(), 16, request_state="online").bytes_per_request_slot == 0
    assert build_layout(tiny(), 16, request_state="online").component("c16_state").unit_bytes == (
        3 * 32 * 4
    )


def test_pro_decode_on_h200_holds_more_with_online_state() -> None:
    def decode(state: str, max_running: int | None) -> tuple[int, int]:
        p = plan(
            PlanInputs(
                model=deepseek_v4_pro(),
                role="decode",
                gpu_memory_bytes=GPU_TYPES["h200"].memory_bytes,
                tp_size=8,
                max_running_requests=max_running,
                request_state=state,  # type: ignore[arg-type]
            )
        )
        return p.max_running_requests, p.ranks[0].capacity.full_tokens

    ring, online = decode("ring", None), decode("online", None)
    assert online[0] > ring[0] and online[1] > ring[1]
    assert (ring, online) == ((425, 1_751_552), (574, 2_352_896))
    # At a fixed request count, the freed state becomes full KV.
    assert decode("ring", 256)[1] == 2_944_512 and decode("online", 256)[1] == 3_683_328
