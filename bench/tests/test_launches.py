"""bench/launches.py: what it counts as a kernel launch, and where it says the launches came
from."""

from __future__ import annotations

import torch
from launches import OUTSIDE, LaunchCounter, by_function

from dsv4_worker.model.ops import rms_norm


def test_counts_computing_operators_and_skips_views_and_allocations() -> None:
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    with LaunchCounter() as counter:
        c = a + b  # 1
        c.view(16).t()  # views: 0
        c.transpose(0, 1).reshape(2, 8)  # reshape of a non-contiguous view copies: 1 (clone)
        torch.empty(8)  # allocation: 0
        c.sum(dim=0)  # 1
        c.to(torch.float32)  # same dtype: no copy, 0
        c.to(torch.float64)  # 1
    assert counter.total == 4, counter.ops
    assert counter.ops["aten.add"] == 1 and counter.ops["aten.sum"] == 1


def test_sites_name_the_calling_worker_function() -> None:
    x = torch.randn(3, 8)
    with LaunchCounter() as counter:
        rms_norm(x, None, 1e-6)
        x * 2  # from here: outside the worker
    functions = by_function(counter.sites)
    assert any(f.startswith("model/ops.py rms_norm") for f in functions), functions
    assert functions[OUTSIDE] == 1, functions
    assert sum(functions.values()) == counter.total
