"""The CUDA probe `dsv4 serve --device cuda` and `dsv4 up` ask before torch is imported: the
driver library's answers become a device list or a reason that names what is missing. Only a
GPU machine has the real libcuda; elsewhere a stand-in answers as the driver API does
(CUresult codes, out-parameters), and the `gpu` test compares the real probe with torch."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from dsv4_worker.devices import LIBCUDA, cuda_devices, torch_cuda_problem

CUDA_ERROR_NO_DEVICE = 100


class StandInDriver:
    """libcuda's five calls the probe makes, answering for `memory_bytes` devices (none:
    cuInit fails with CUDA_ERROR_NO_DEVICE, as the real driver does)."""

    def __init__(self, memory_bytes: tuple[int, ...]) -> None:
        self.memory_bytes = memory_bytes

    def cuInit(self, flags: int) -> int:
        return 0 if self.memory_bytes else CUDA_ERROR_NO_DEVICE

    def cuDeviceGetCount(self, count: Any) -> int:
        count._obj.value = len(self.memory_bytes)
        return 0

    def cuDeviceGet(self, device: Any, index: int) -> int:
        device._obj.value = index
        return 0

    def cuDeviceTotalMem_v2(self, total: Any, device: ctypes.c_int) -> int:
        total._obj.value = self.memory_bytes[device.value]
        return 0

    def cuGetErrorName(self, status: int, name: Any) -> int:
        if status != CUDA_ERROR_NO_DEVICE:
            return 1  # CUDA_ERROR_INVALID_VALUE: an unknown code
        name._obj.value = b"CUDA_ERROR_NO_DEVICE"
        return 0


def loader(driver: StandInDriver) -> Any:
    def load(name: str) -> StandInDriver:
        assert name == LIBCUDA
        return driver

    return load


@pytest.fixture(autouse=True)
def every_device_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_devices_and_their_memory_as_the_driver_reports_them() -> None:
    found = cuda_devices(loader(StandInDriver((143_771 << 20, 80 << 30))))
    assert (found.count, found.memory_bytes, found.missing) == (2, (143_771 << 20, 80 << 30), "")


def test_no_driver_library_names_it() -> None:
    def absent(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    found = cuda_devices(absent)
    assert found.count == 0
    assert found.missing == (
        "no NVIDIA driver on this machine (libcuda.so.1: cannot open shared object file: No "
        "such file or directory)"
    )


def test_a_driver_without_a_device_names_the_error() -> None:
    found = cuda_devices(loader(StandInDriver(())))
    assert found.count == 0
    assert found.missing == "the NVIDIA driver sees no usable GPU (CUDA_ERROR_NO_DEVICE (100))"


@pytest.mark.parametrize("visible", ["", "-1"])
def test_cuda_visible_devices_hiding_every_gpu_is_named(
    visible: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = cuda_devices(loader(StandInDriver((1 << 30,))))
    assert found.count == 0 and f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU" in found.missing


def test_the_installed_torch_says_whether_it_has_cuda() -> None:
    """Read from the wheel's files; agrees with what torch itself says."""
    import torch

    problem = torch_cuda_problem()
    if torch.version.cuda is None:
        assert problem is not None and "is a CPU-only build" in problem
        assert torch.__version__ in problem
    else:
        assert problem is None


@pytest.mark.gpu
def test_the_real_probe_sees_what_torch_sees() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    found = cuda_devices()
    assert found.count == torch.cuda.device_count()
    assert found.memory_bytes == tuple(
        torch.cuda.get_device_properties(i).total_memory for i in range(found.count)
    )
