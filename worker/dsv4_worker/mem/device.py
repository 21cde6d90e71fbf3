"""Where host values meet device tensors: the DSV4_EMULATE_DEVICE switch and sync-free uploads.

Hot paths decide on the host (numpy and Python values) and hand the device only what its
kernels read, through `upload`. On a CPU the "device" is host memory, and code may take host
shortcuts on it (numpy views, plain reads of small tensors); DSV4_EMULATE_DEVICE=1 turns every
shortcut off, so a CPU takes exactly the code a CUDA device takes and a test can count the
calls that would make the host wait for the device there (`sync_counter.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

EMULATE_ENV = "DSV4_EMULATE_DEVICE"


def emulating(environ: Mapping[str, str] = os.environ) -> bool:
    """DSV4_EMULATE_DEVICE=1: a CPU takes the code a CUDA device takes."""
    return environ.get(EMULATE_ENV, "") == "1"


def host_shortcuts(device: torch.device) -> bool:
    """Whether code may read `device`'s tensors directly on the host: on a CPU, unless
    DSV4_EMULATE_DEVICE=1 asks for the device's code."""
    return device.type == "cpu" and not emulating()


def upload(values: np.ndarray, device: torch.device) -> Tensor:
    """A host int64 array as a new tensor on `device`, with no device sync: a non-blocking copy
    from pageable memory (CUDA stages it at once, so `values` may change afterwards). On a CPU
    the tensor shares `values`' memory: callers pass arrays they built for the call."""
    return torch.from_numpy(values).to(device, non_blocking=True)
