"""KV memory: pools (torch buffers), paged allocators, SWA window eviction, request state, CPU offload."""
