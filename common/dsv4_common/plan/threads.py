"""How many torch threads a worker runs, from the CPUs it may use. Pure.

The rule (the worker applies it to the CPUs its cgroup quota and affinity allow; the operator
to the pod's CPU request, which is all the CPU a pod without a limit is promised; `dsv4 up` to
its machine's CPUs split evenly over the worker ranks it runs side by side):

    intra-op threads = max(1, floor(cpus) - RESERVED_CPUS)
    inter-op threads = INTEROP_THREADS

RESERVED_CPUS is one core for the worker's own threads: the asyncio loop (HTTP, SSE,
tokenizing), the PD control and transfer threads, and whatever else shares the machine. An
OpenMP parallel region ends at a barrier, so a torch thread that another thread or process
keeps off its core stalls every op of the step, not just its share. Measured on a 2-core VM
(#38, docs/real-model.md "Torch threads"): serving tiny and medium over HTTP, one torch thread
gave 1.4-2x the tokens/s of two; in one process with nothing else running, two threads gave
medium's 16-request decode 1.2x and its 1-request decode nothing. On a many-core node the core
kept back costs at most 1/cpus of the arithmetic. `--torch-threads` (or the rank config's
`torch_threads`) overrides the rule. The inter-op pool serves only `torch.jit.fork` and a few
parallel ops the eager forward never uses: one thread.

Torch's OpenMP workers spin ~0.3 ms after a parallel region, then sleep (`GOMP_SPINCOUNT=10000`,
set by `dsv4_worker` before torch loads unless the environment sets it or `OMP_WAIT_POLICY`):
a step's regions follow each other within microseconds, and a worker that slept after each one
paid a wake-up per op, while libgomp's default spin (~8 ms after every region) would burn the
cores and a CPU quota whenever the worker idles.
"""

from __future__ import annotations

import math
from typing import Final

RESERVED_CPUS: Final = 1
INTEROP_THREADS: Final = 1


def torch_threads(cpus: float) -> int:
    """Intra-op threads for a process that may use `cpus` cores (fractions from quotas)."""
    if not cpus > 0:
        raise ValueError(f"cpus={cpus}: must be > 0")
    return max(1, math.floor(cpus + 1e-9) - RESERVED_CPUS)
