"""dsv4-serve GPU worker.

NOTE: torch's OpenMP workers spin briefly after a parallel region, then sleep (libgomp's
`GOMP_SPINCOUNT=10000` with no `OMP_WAIT_POLICY`: ~0.3 ms of spinning), unless the environment
sets either variable. A decode step runs its parallel regions microseconds apart, so workers
that slept after each one (`OMP_WAIT_POLICY=PASSIVE`, this package's choice before) paid a
futex wake-up per op: medium's decode step at two threads took 23-34 ms where 17-23 ms with the
brief spin, slower than one thread (docs/real-model.md "Torch threads"). libgomp's own default
spins 300,000 times (~8 ms after every region on the 2-core EPYC), burning a CPU quota's time;
a worker gives torch all but one of the CPUs it may use (`dsv4_common.plan.threads`), and the
kept core runs its event loop and PD threads. libgomp reads the variables once, when torch
loads; this package is imported before any of its modules imports torch.
"""

import os

SPIN_COUNT = "10000"

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
