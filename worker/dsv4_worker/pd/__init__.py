"""PD disaggregation: prefill and decode roles, KV/state transfer."""
