"""Shared vocabulary: model configs, the KV layout spec, index spaces. Pure Python."""
