"""dsv4-serve Kubernetes operator."""
