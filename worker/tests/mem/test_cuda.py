"""Same code on CUDA: every allocator decision and every byte equals the CPU run (lent GPU only)."""

from __future__ import annotations

import pytest
import torch
from mem_helpers import small_memory

from dsv4_worker.mem.errors import OutOfPages
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.mem.offload import offload_request, reload_request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _script(mem: KVMemory) -> list[torch.Tensor]:
    """One fixed interleaving of every operation; returns everything observable, on CPU."""
    dev = mem.device

    def t(*v: int) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64, device=dev)

    gen = torch.Generator().manual_seed(7)
    assert mem.pool is not None
    for c in mem.layout.components:
        raw = mem.pool.unit_bytes_view(c.name)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8).to(dev))
    out: list[torch.Tensor] = []
    a = mem.pages
    slots = mem.open(3)
    out.append(a.extend(slots, t(40, 7, 19)))
    for _ in range(20):
        out.append(a.decode(slots))
    out.append(t(a.evict_window()))
    tail = mem.open(1)
    a.alloc_tail(tail, t(75))
    with pytest.raises(OutOfPages):
        a.extend(slots, t(190, 190, 190))  # SWA short: all-or-nothing on the device too
    snap = offload_request(mem, int(slots[0]))
    out += [snap.swa_mask, *snap.data.values()]
    reloaded = reload_request(mem, snap)
    out.append(t(reloaded))
    mem.free(slots[1:])
    mem.check_integrity()
    out += [
        a.page_table,
        a.num_tokens,
        a.swa_start_tokens,
        a.full_to_swa,
        torch.from_numpy(a.full.owner),  # host state
        torch.from_numpy(a.swa.owner),
        *(mem.pool.buffer(c.name) for c in mem.layout.components),
    ]
    # As raw bytes: the random fill holds NaN patterns, and NaN != NaN in a float compare.
    return [x.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for x in out]


@pytest.mark.parametrize("preset", ["tiny", "hybrid-tiny"])
def test_cuda_matches_cpu_decision_for_decision_and_byte_for_byte(preset: str) -> None:
    sizes = dict(full_pages=64, swa_pages=24, slots=6, max_pages=16)
    cpu = _script(small_memory(preset, device="cpu", **sizes))
    cuda = _script(small_memory(preset, device="cuda", **sizes))
    assert len(cpu) == len(cuda)
    for i, (x, y) in enumerate(zip(cpu, cuda, strict=True)):
        assert torch.equal(x, y), f"step {i} differs"
