"""The planner: model + role + parallelism + memory -> per-PP-rank KV plan. Never imports torch."""
