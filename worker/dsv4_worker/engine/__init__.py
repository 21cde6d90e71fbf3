"""The engine: the paged forward over the KV pools, batches and sampling."""
