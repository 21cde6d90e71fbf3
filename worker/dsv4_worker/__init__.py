"""dsv4-serve GPU worker."""
