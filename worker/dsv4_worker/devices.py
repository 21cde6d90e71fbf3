"""Which CUDA devices this machine has, found without importing torch (1.5-2 s): through the
NVIDIA driver's own library, libcuda, which torch's CUDA runtime uses too, so the devices and
their memory are the ones torch would see (`CUDA_VISIBLE_DEVICES` applies to both). Side
effects: loads libcuda and initializes the driver API (no context is created).

`dsv4 serve --device cuda` checks here before it imports torch; `dsv4 up` refuses a GPU
deployment on a machine where this finds none.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["CudaDevices", "cuda_devices", "torch_cuda_problem"]

LIBCUDA: Final = "libcuda.so.1"
_SUCCESS: Final = 0


@dataclass(frozen=True, slots=True)
class CudaDevices:
    memory_bytes: tuple[int, ...]  # per visible device, as the driver reports it (torch's figure)
    missing: str  # why there is none ("" when there is one)

    @property
    def count(self) -> int:
        return len(self.memory_bytes)


def cuda_devices(load: Callable[[str], Any] = ctypes.CDLL) -> CudaDevices:
    """The visible CUDA devices and their memory, or why there are none. `load`: how the driver
    library is opened (tests hand in a stand-in; only a GPU machine has the real one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return CudaDevices((), f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")
    try:
        cuda = load(LIBCUDA)
    except OSError as exc:
        return CudaDevices((), f"no NVIDIA driver on this machine ({exc})")
    status = cuda.cuInit(0)
    if status != _SUCCESS:
        return CudaDevices(
            (), f"the NVIDIA driver sees no usable GPU ({_error_name(cuda, status)})"
        )
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != _SUCCESS or count.value == 0:
        why = _error_name(cuda, status) if status != _SUCCESS else "0 devices"
        return CudaDevices((), f"the NVIDIA driver sees no GPU ({why})")
    memory: list[int] = []
    for index in range(count.value):
        device, total = ctypes.c_int(0), ctypes.c_size_t(0)
        status = cuda.cuDeviceGet(ctypes.byref(device), index)
        if status == _SUCCESS:
            status = cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device)
        if status != _SUCCESS:
            return CudaDevices((), f"GPU {index}: {_error_name(cuda, status)}")
        memory.append(total.value)
    return CudaDevices(tuple(memory), "")


def torch_cuda_problem() -> str | None:
    """Why the installed torch cannot run on CUDA (a CPU-only build), else None; read from the
    wheel's files, not by importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "torch is not installed"
    lib = Path(spec.origin).parent / "lib"
    if any(lib.glob("libtorch_cuda*.so")):
        return None
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return f"the installed torch ({version}) is a CPU-only build (no libtorch_cuda in {lib})"


def _error_name(cuda: Any, status: int) -> str:
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(status, ctypes.byref(name)) == _SUCCESS and name.value:
        return f"{name.value.decode()} ({status})"
    return f"CUresult {status}"
