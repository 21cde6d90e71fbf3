"""The sync counter counts what it must (issue #38 item 5): each kind of call that makes the
host wait for a CUDA device counts once on a device tensor, none on a host tensor, and the
calls that never sync (indexing with integer tensors, arithmetic, non-blocking uploads, sized
repeat_interleave) count nothing. The patterns are the ones the allocator's previous code used,
so a regression to any of them shows in `test_syncs.py`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from dsv4_worker.mem.device import upload
from dsv4_worker.mem.sync_counter import SyncCounter, is_host

DEV = torch.device("cpu")  # the emulated device: tensors made with it are device tensors

SYNCS: dict[str, Callable[[Tensor], object]] = {
    "item": lambda x: x[0].item(),
    "tolist": lambda x: x.tolist(),
    "bool": lambda x: bool(x[0]),
    "if": lambda x: 1 if x[0] else 0,
    "int": lambda x: int(x[1]),
    "index": lambda x: [0, 1, 2][x[1]],
    "float": lambda x: float(x[1]),
    "format": lambda x: f"{x[0]}",
    "any as bool": lambda x: bool(torch.any(x > 3)),
    "all as bool": lambda x: bool((x >= 0).all()),
    "nonzero": lambda x: x.nonzero(),
    "torch.nonzero": lambda x: torch.nonzero(x),
    "where(cond)": lambda x: torch.where(x > 2),
    "argwhere": lambda x: torch.argwhere(x),
    "equal": lambda x: torch.equal(x, x),
    "allclose": lambda x: torch.allclose(x.double(), x.double()),
    "masked_select": lambda x: x.masked_select(x > 2),
    "bool-mask get": lambda x: x[x > 2],
    "bool-mask set": lambda x: x.__setitem__(x > 2, 0),
    "unique": lambda x: torch.unique(x),
    "unique_consecutive": lambda x: torch.unique_consecutive(x),
    "bincount": lambda x: torch.bincount(x),
    "repeat_interleave(repeats)": lambda x: torch.repeat_interleave(x, x),
    "repeat_interleave(x)": lambda x: torch.repeat_interleave(x),
    "cpu": lambda x: x.cpu(),
    "to cpu": lambda x: x.to("cpu"),
    "numpy": lambda x: x.numpy(),
    "np.asarray": lambda x: np.asarray(x),
    "tensor(device=)": lambda x: torch.tensor([1, 2], device=x.device),
    "as_tensor(device=)": lambda x: torch.as_tensor([1, 2], device=x.device),
    "blocking upload": lambda x: torch.tensor([1, 2]).to(x.device),
    "blocking upload of numpy": lambda x: torch.from_numpy(np.arange(3)).to(x.device),
    "copy_ from host": lambda x: x.copy_(torch.tensor([5, 4, 3, 2, 1, 0])),
    "arange(tensor)": lambda x: torch.arange(x[3]),
    "slice by tensor": lambda x: x[: x[2]],
}

FREE: dict[str, Callable[[Tensor], object]] = {
    "index_select": lambda x: x.index_select(0, x[:2]),
    "integer-tensor index": lambda x: x[x[:2]],
    "arithmetic": lambda x: (x * 2 + 1) // 3 % 5,
    "reductions as tensors": lambda x: (x.sum(), x.max(), torch.aminmax(x), (x > 1).any()),
    "sized repeat_interleave": lambda x: torch.repeat_interleave(x, x, output_size=15),
    "scalar index": lambda x: x[1],
    "index_copy_": lambda x: x.index_copy_(0, x[:1].clone(), x[1:2].clone()),
    "masked_fill": lambda x: x.masked_fill(x > 2, 0),
    "where(cond, a, b)": lambda x: torch.where(x > 2, x, 0),
    "factory on the device": lambda x: torch.zeros(3, device=x.device),
    "upload": lambda x: upload(np.arange(3), x.device),
    "shape": lambda x: (x.shape, x.numel(), len(x), x.dim()),
    "host tensor made and read": lambda x: torch.tensor([1, 2]).tolist(),
    "host tensor arithmetic read": lambda x: int((torch.tensor([3]) * 2)[0]),
}


def _count(fn: Callable[[Tensor], object]) -> SyncCounter:
    x = torch.arange(6, device=DEV)  # made outside the counter: a device tensor
    with SyncCounter() as counter:
        fn(x)
    return counter


@pytest.mark.parametrize("kind", sorted(SYNCS))
def test_each_syncing_call_counts_once(kind: str) -> None:
    counter = _count(SYNCS[kind])
    assert counter.total == 1, dict(counter.counts)


@pytest.mark.parametrize("kind", sorted(FREE))
def test_calls_that_never_sync_count_nothing(kind: str) -> None:
    counter = _count(FREE[kind])
    assert counter.total == 0, dict(counter.counts)


def test_a_read_back_is_a_new_host_tensor_and_the_device_tensor_stays_a_device_tensor() -> None:
    x = torch.arange(4)
    with SyncCounter() as counter:
        host = x.cpu()  # on the CPU this would be `x` itself: the counter copies, as CUDA
        host.tolist()
        x.tolist()
    assert host is not x and is_host(host) and not is_host(x)
    assert counter.counts == {"cpu": 1, "tolist": 1}


def test_counts_add_up_over_a_region() -> None:
    x = torch.arange(6)
    with SyncCounter() as counter:
        for _ in range(3):
            int(x[0])
        x.nonzero()
    assert counter.total == 4 and counter.counts == {"__int__": 3, "nonzero": 1}
