"""Scheduling decisions, pure (no tensors): resource arithmetic, admission, the step plan."""
