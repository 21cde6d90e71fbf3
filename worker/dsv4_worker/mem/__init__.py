"""KV memory: pool buffers, paged allocators, SWA window eviction, request state, CPU offload.

Bytes: `pool` (KVPool). Indices, all decided on the host: `page_allocator` (free list +
owners), `req_slots`, `kv_allocator` (full pages, SWA pages, full->SWA mapping, `can_extend` /
`can_decode`), `tables` (host tables and the device's copies), `alloc_config`, `integrity`,
`held` (what a free releases), `runs`. Also `args` (argument checks at the package's edges),
`device` (DSV4_EMULATE_DEVICE and sync-free uploads), `sync_counter` (counts the calls that
sync on CUDA: tests and benches), `index` (vectorized index conversions), `offload`
(retraction), `usage` (counters), `errors` (+ `Verdict`), and `memory` (KVMemory: the facade
sized from a planner RankPlan).
"""
