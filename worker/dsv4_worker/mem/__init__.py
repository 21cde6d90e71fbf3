"""KV memory: pool buffers, paged allocators, SWA window eviction, request state, CPU offload.

Bytes: `pool` (KVPool). Indices: `page_allocator` (free stack + owners), `req_slots`,
`kv_allocator` (full pages, SWA pages, full->SWA mapping), `alloc_config`, `integrity`.
Also `index` (vectorized index conversions), `offload` (retraction), `usage` (counters),
`errors`, and `memory` (KVMemory: the facade sized from a planner RankPlan).
"""
