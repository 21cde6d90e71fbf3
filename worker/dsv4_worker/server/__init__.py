"""The worker's HTTP API: request parsing, the app, metrics."""
