"""KV memory: pool buffers, paged allocators, SWA window eviction, request state, CPU offload.

Bytes: `pool` (KVPool). Indices: `page_allocator` (free list + owners), `req_slots`,
`kv_allocator` (full pages, SWA pages, full->SWA mapping, `can_extend` / `can_decode`),
`alloc_config`, `integrity`, `held` (what a free releases), `page_math`, `scratch`, `reads`.
Also `args` (argument checks at the package's edges), `index` (vectorized index conversions),
`offload` (retraction), `usage` (counters), `errors` (+ `Verdict`), and `memory` (KVMemory:
the facade sized from a planner RankPlan).
"""
