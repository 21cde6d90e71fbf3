"""How many torch threads a worker runs, from the CPUs it may use. Pure.

The rule (the worker applies it to the CPUs its cgroup quota and affinity allow; the operator
to the pod's CPU request, which is all the CPU a pod without a limit is promised):

    intra-op threads = max(1, floor(cpus) - RESERVED_CPUS)
    inter-op threads = INTEROP_THREADS

RESERVED_CPUS is one core for the worker's own Python threads: the asyncio loop (HTTP, SSE,
tokenizing), the PD transfer thread and the GIL handoffs between them and the engine thread.
On a 2-core machine serving tiny, one torch thread served about 2x the tokens/s of torch's
default (one per core), whose threads fought the event loop (issue #26). The inter-op pool
serves only `torch.jit.fork` and a few parallel ops the eager forward never uses: one thread.
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
