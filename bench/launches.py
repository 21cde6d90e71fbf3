"""Counts the torch operators a piece of code runs that launch a kernel on a GPU, on any device
(benches only): an eager decode step on CUDA is bound by its launches (bench/README.md, "Measured
on a GPU": a tiny step, 2,921 launches, 44 ms), so their count, taken on the CPU under
DSV4_EMULATE_DEVICE=1 (the code CUDA runs), says where a GPU step's time goes before a GPU is
lent.

Counted: every ATen operator that reaches dispatch and is neither a view (`_unsafe_view` too)
nor a bare allocation (`empty*`, `lift_fresh`, `detach`). An approximation of cudaLaunchKernel:
a cuBLAS product may launch more than one kernel, and a copy between host and device counts as
one here.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any, Final

from torch.utils._python_dispatch import TorchDispatchMode

_NO_KERNEL: Final = frozenset(
    {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.lift_fresh"}
    | {"aten.detach", "aten.alias", "aten.set_", "aten.resize_", "aten._unsafe_view"}
)
_PACKAGE: Final = "dsv4_worker/"
OUTSIDE: Final = "(outside dsv4_worker)"


class LaunchCounter(TorchDispatchMode):
    """Within `with LaunchCounter() as c:`, `c.ops` counts the kernel-launching operators by
    name and `c.sites` by the innermost dsv4_worker line that called them ("file:line func")."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _site() -> str:
    for frame in reversed(traceback.extract_stack(limit=24)[:-2]):
        at = frame.filename.rfind(_PACKAGE)
        if at >= 0:
            return f"{frame.filename[at + len(_PACKAGE) :]}:{frame.lineno} {frame.name}"
    return OUTSIDE


def by_function(sites: Counter[str]) -> Counter[str]:
    """`sites` summed per function ("file func"), lines dropped."""
    out: Counter[str] = Counter()
    for site, n in sites.items():
        where, _, func = site.partition(" ")
        out[site if site == OUTSIDE else f"{where.rsplit(':', 1)[0]} {func}"] += n
    return out
