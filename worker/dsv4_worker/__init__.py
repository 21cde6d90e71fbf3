"""dsv4-serve GPU worker.

NOTE: torch's OpenMP workers sleep between parallel regions instead of spinning (libgomp's
`OMP_WAIT_POLICY=PASSIVE`), unless the environment chooses: a worker gives torch all but one of
the CPUs it may use (`dsv4_common.plan.threads`), and a spinning torch thread takes the core its
event loop and PD threads need. libgomp reads the variable once, when torch loads; this package is
imported before any of its modules imports torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
