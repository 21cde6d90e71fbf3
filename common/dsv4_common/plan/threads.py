"""How many torch threads a worker runs, from the CPUs it may use. Pure.

The rule (the worker applies it to the CPUs its cgroup quota and affinity allow; the operator
to the pod's CPU request, which is all the CPU a pod without a limit is promised; `dsv4 up` to
its machine's CPUs split evenly over the worker ranks it runs side by side):

    intra-op threads = max(1, floor(cpus))
    inter-op threads = INTEROP_THREADS

Every usable CPU goes to torch (#38: a lone `dsv4 serve` on a 2-core machine took 1 of 2,
and computing in float32 at hidden 1024 is bound by arithmetic, not dispatch). The worker's
own Python threads (the asyncio loop, the PD control and transfer threads) mostly wait; what
made a second torch thread cost tokens/s in issue #26 was torch's OpenMP workers spinning
between parallel regions on the core the event loop needed, so the worker makes them sleep
instead (`OMP_WAIT_POLICY=PASSIVE`, set by `dsv4_worker` before torch loads unless the
environment already sets it). The inter-op pool serves only `torch.jit.fork` and a few
parallel ops the eager forward never uses: one thread.
"""

from __future__ import annotations

import math
from typing import Final

INTEROP_THREADS: Final = 1


def torch_threads(cpus: float) -> int:
    """Intra-op threads for a process that may use `cpus` cores (fractions from quotas)."""
    if not cpus > 0:
        raise ValueError(f"cpus={cpus}: must be > 0")
    return max(1, math.floor(cpus + 1e-9))
